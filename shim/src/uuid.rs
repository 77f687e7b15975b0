//! GPU UUIDs as text.
//!
//! A leaf: the enforcer names the region's devices by it, and the context
//! measurement asks NVML for a device by it.

/// Formats a UUID the way NVML and `nvidia-smi` print it.
pub fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex[0..4].concat(),
        hex[4..6].concat(),
        hex[6..8].concat(),
        hex[8..10].concat(),
        hex[10..16].concat()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_reads_as_nvml_prints_it() {
        let bytes: [u8; 16] = std::array::from_fn(|i| (i as u8) * 0x11);
        assert_eq!(
            format_uuid(&bytes),
            "GPU-00112233-4455-6677-8899-aabbccddeeff"
        );
    }
}
