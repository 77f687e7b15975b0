//! Taking single GPUs of a node out of service: the node annotation that
//! lists them, in vgpu's spelling or HAMi's.
//!
//! `kubectl annotate node <node> vgpu.io/cordoned-gpus=GPU-a,GPU-b` (or
//! `hami.io/device-cordon=...`, as HAMi users write it): the listed GPUs
//! get no new vGPU, and what already runs on them is left alone. The
//! extender stops placing on them and the DRA driver takes them out of
//! its ResourceSlice, each with the node's next watch event, so it takes
//! effect at once and ends when the annotation goes.

use std::collections::BTreeMap;

/// vgpu's node annotation: GPU UUIDs, separated by commas.
pub const CORDONED_GPUS_ANNOTATION: &str = "vgpu.io/cordoned-gpus";
/// HAMi's node annotation of the same meaning.
pub const HAMI_DEVICE_CORDON_ANNOTATION: &str = "hami.io/device-cordon";

/// The UUIDs a node's annotations cordon (both spellings together).
pub fn cordoned_gpus(annotations: Option<&BTreeMap<String, String>>) -> Vec<&str> {
    let Some(annotations) = annotations else {
        return Vec::new();
    };
    [CORDONED_GPUS_ANNOTATION, HAMI_DEVICE_CORDON_ANNOTATION]
        .iter()
        .filter_map(|key| annotations.get(*key))
        .flat_map(|list| list.split(','))
        .map(str::trim)
        .filter(|uuid| !uuid.is_empty())
        .collect()
}

/// A cordon list after cordoning `add` and uncordoning `remove`, in the
/// annotation's form: UUIDs joined by commas, each once, in the order first
/// cordoned; `None` when nothing stays cordoned (the annotation goes).
pub fn edited_list(current: Option<&str>, add: &[&str], remove: &[&str]) -> Option<String> {
    let mut kept: Vec<&str> = Vec::new();
    let listed = current
        .into_iter()
        .flat_map(|list| list.split(','))
        .map(str::trim);
    for uuid in listed.chain(add.iter().copied()) {
        if !uuid.is_empty() && !kept.contains(&uuid) && !remove.contains(&uuid) {
            kept.push(uuid);
        }
    }
    (!kept.is_empty()).then(|| kept.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_is_edited_keeping_its_order_each_uuid_once() {
        assert_eq!(edited_list(None, &["GPU-a"], &[]).as_deref(), Some("GPU-a"));
        assert_eq!(
            edited_list(Some("GPU-a, GPU-b,,"), &["GPU-c", "GPU-a"], &[]).as_deref(),
            Some("GPU-a,GPU-b,GPU-c")
        );
        assert_eq!(
            edited_list(Some("GPU-a,GPU-b"), &[], &["GPU-a"]).as_deref(),
            Some("GPU-b")
        );
        assert_eq!(edited_list(Some("GPU-a"), &[], &["GPU-a"]), None);
        assert_eq!(edited_list(Some(" , "), &[], &[]), None);
    }

    #[test]
    fn both_spellings_are_read_as_trimmed_comma_lists() {
        let annotations = BTreeMap::from([
            (
                CORDONED_GPUS_ANNOTATION.to_string(),
                " GPU-a, ,GPU-b ".to_string(),
            ),
            (
                HAMI_DEVICE_CORDON_ANNOTATION.to_string(),
                "GPU-c".to_string(),
            ),
            ("other".to_string(), "GPU-d".to_string()),
        ]);
        assert_eq!(
            cordoned_gpus(Some(&annotations)),
            vec!["GPU-a", "GPU-b", "GPU-c"]
        );
        assert!(cordoned_gpus(None).is_empty());
        assert!(cordoned_gpus(Some(&BTreeMap::new())).is_empty());
    }
}
