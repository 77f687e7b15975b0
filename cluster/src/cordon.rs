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

#[cfg(test)]
mod tests {
    use super::*;

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
