//! What pods ask for: the extended resource names and pod annotations vgpu
//! understands, and Kubernetes quantities as the API server writes them.
//!
//! Resource values arrive as Kubernetes *quantities*, in the canonical form
//! the API server stores: `nvidia.com/gpumem: 3000` is sent back as `"3k"`,
//! `4096` stays `"4096"`. [`parse_whole_quantity`] reads every form the API
//! server produces (decimal and binary SI suffixes, exponents, decimal
//! points) and accepts exactly the whole, non-negative numbers. Note that in
//! a quantity `m` means *milli* (`500m` = 0.5), unlike the byte sizes of
//! [`crate::quantity`], where `m` means MiB.

use thiserror::Error;

/// Number of vGPUs of a container (each on a different physical GPU).
pub const GPU_COUNT: &str = "nvidia.com/gpu";
/// Device memory per vGPU, in MiB.
pub const GPU_MEMORY: &str = "nvidia.com/gpumem";
/// Device memory per vGPU, in percent of the GPU's memory.
pub const GPU_MEMORY_PERCENTAGE: &str = "nvidia.com/gpumem-percentage";
/// Compute share per vGPU, in percent (100: the whole GPU, exclusively).
pub const GPU_CORES: &str = "nvidia.com/gpucores";
/// `CUDA_TASK_PRIORITY` of the container (lower is more important).
pub const GPU_PRIORITY: &str = "nvidia.com/priority";
/// Elastic GPU's device memory request, in MB (read as MiB).
pub const ELASTIC_GPU_MEMORY: &str = "elasticgpu.io/gpu-memory";
/// Elastic GPU's compute request, in percent of one GPU; 200 = two whole GPUs.
pub const ELASTIC_GPU_CORE: &str = "elasticgpu.io/gpu-core";

/// The extended resource names vgpu reads, each configurable (a cluster
/// may keep HAMi's or Elastic GPU's names under another prefix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceNames {
    pub gpu: String,
    pub memory: String,
    pub memory_percentage: String,
    pub cores: String,
    pub priority: String,
    pub elastic_memory: String,
    pub elastic_cores: String,
}

impl Default for ResourceNames {
    fn default() -> Self {
        Self {
            gpu: GPU_COUNT.into(),
            memory: GPU_MEMORY.into(),
            memory_percentage: GPU_MEMORY_PERCENTAGE.into(),
            cores: GPU_CORES.into(),
            priority: GPU_PRIORITY.into(),
            elastic_memory: ELASTIC_GPU_MEMORY.into(),
            elastic_cores: ELASTIC_GPU_CORE.into(),
        }
    }
}

/// The command-line flags naming the resources that say how much of a GPU a
/// container gets (all but the GPU count, which a device plugin offers),
/// the same in every binary that reads them; the chart passes the same
/// values to each.
#[derive(Clone, Debug, clap::Args)]
pub struct ShareResourceFlags {
    /// Resource name: device memory per vGPU in MiB.
    #[arg(long, default_value = GPU_MEMORY, value_name = "NAME")]
    pub resource_memory: String,

    /// Resource name: device memory per vGPU in percent of the GPU.
    #[arg(long, default_value = GPU_MEMORY_PERCENTAGE, value_name = "NAME")]
    pub resource_memory_percentage: String,

    /// Resource name: compute share per vGPU in percent.
    #[arg(long, default_value = GPU_CORES, value_name = "NAME")]
    pub resource_cores: String,

    /// Resource name: task priority of the container (lower is more important).
    #[arg(long, default_value = GPU_PRIORITY, value_name = "NAME")]
    pub resource_priority: String,

    /// Resource name: Elastic GPU device memory in MB (read as MiB).
    #[arg(long, default_value = ELASTIC_GPU_MEMORY, value_name = "NAME")]
    pub resource_elastic_memory: String,

    /// Resource name: Elastic GPU compute in percent (200 = two whole GPUs).
    #[arg(long, default_value = ELASTIC_GPU_CORE, value_name = "NAME")]
    pub resource_elastic_cores: String,
}

impl ShareResourceFlags {
    /// All the names, with `gpu` the GPU count's.
    pub fn names(&self, gpu: &str) -> ResourceNames {
        ResourceNames {
            gpu: gpu.to_string(),
            memory: self.resource_memory.clone(),
            memory_percentage: self.resource_memory_percentage.clone(),
            cores: self.resource_cores.clone(),
            priority: self.resource_priority.clone(),
            elastic_memory: self.resource_elastic_memory.clone(),
            elastic_cores: self.resource_elastic_cores.clone(),
        }
    }
}

/// Pod annotation: only GPUs whose model contains one of these
/// (comma-separated, case-insensitive).
pub const USE_GPU_TYPE_ANNOTATION: &str = "nvidia.com/use-gputype";
/// Pod annotation: no GPU whose model contains one of these.
pub const NOUSE_GPU_TYPE_ANNOTATION: &str = "nvidia.com/nouse-gputype";
/// Pod annotation (nvidia-gpu-scheduler's): only GPUs of this model, and
/// nodes with more of them preferred. Compared case-insensitively, with
/// spaces, `-` and `_` alike (label-safe spellings such as
/// `NVIDIA-GeForce-GTX-1080` match `NVIDIA GeForce GTX 1080`), with the
/// whole of the model's name as NVML gives it.
pub const GPU_MODEL_ANNOTATION: &str = "nvidia-gpu-scheduler/gpu.model";
/// Pod annotation: only these GPU UUIDs (comma-separated).
pub const USE_GPU_UUID_ANNOTATION: &str = "nvidia.com/use-gpuuuid";
/// Pod annotation: none of these GPU UUIDs.
pub const NOUSE_GPU_UUID_ANNOTATION: &str = "nvidia.com/nouse-gpuuuid";

/// Pod annotation: how far above its compute share (percent of the GPU,
/// 1-100) each of the pod's capped vGPUs may run while the GPU has idle
/// capacity; the node monitor lends it and takes it back when the owners
/// return.
pub const GPU_CORES_BURST_ANNOTATION: &str = "vgpu.io/gpucores-burst";

/// Why a Kubernetes quantity is not a usable whole number.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum KubeQuantityError {
    #[error("empty quantity")]
    Empty,
    #[error(
        "{0:?} is not a Kubernetes quantity (a number with an optional suffix such as k, M, Gi)"
    )]
    Malformed(String),
    #[error("{0:?} is negative")]
    Negative(String),
    #[error("{0:?} is not a whole number")]
    Fractional(String),
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Parses a Kubernetes quantity (`"3"`, `"3k"`, `"4Gi"`, `"1e3"`, `"2.5k"`)
/// that must be a whole, non-negative number.
pub fn parse_whole_quantity(text: &str) -> Result<u64, KubeQuantityError> {
    let quantity = text.trim();
    if quantity.is_empty() {
        return Err(KubeQuantityError::Empty);
    }
    let malformed = || KubeQuantityError::Malformed(text.to_string());
    let (negative, unsigned) = match quantity.as_bytes()[0] {
        b'-' => (true, &quantity[1..]),
        b'+' => (false, &quantity[1..]),
        _ => (false, quantity),
    };
    let number_end = unsigned
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(number_end);
    let (whole, fraction) = match number.split_once('.') {
        Some((whole, fraction)) => (whole, fraction),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(malformed());
    }
    let (decimal_exponent, binary_shift): (i64, u32) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        exponent if exponent.starts_with(['e', 'E']) => {
            let digits = &exponent[1..];
            let valid = digits
                .strip_prefix(['+', '-'])
                .unwrap_or(digits)
                .bytes()
                .all(|b| b.is_ascii_digit());
            if digits.is_empty() || !valid {
                return Err(malformed());
            }
            (digits.parse::<i64>().map_err(|_| malformed())?, 0)
        }
        _ => return Err(malformed()),
    };

    // The digits as one integer, with the decimal point moved into the exponent.
    let mut mantissa: u128 = 0;
    for digit in whole.bytes().chain(fraction.bytes()) {
        mantissa = mantissa
            .checked_mul(10)
            .and_then(|m| m.checked_add(u128::from(digit - b'0')))
            .ok_or_else(|| KubeQuantityError::TooLarge(text.to_string()))?;
    }
    if mantissa == 0 {
        return Ok(0);
    }
    if negative {
        return Err(KubeQuantityError::Negative(text.to_string()));
    }
    let exponent = decimal_exponent - fraction.len() as i64;
    let too_large = || KubeQuantityError::TooLarge(text.to_string());
    let mut value = mantissa;
    if exponent >= 0 {
        if exponent > 38 {
            return Err(too_large());
        }
        value = value
            .checked_mul(10u128.pow(exponent as u32))
            .ok_or_else(too_large)?;
    } else {
        let divisor_exponent = exponent.unsigned_abs();
        if divisor_exponent > 38 {
            return Err(KubeQuantityError::Fractional(text.to_string()));
        }
        let divisor = 10u128.pow(divisor_exponent as u32);
        if !value.is_multiple_of(divisor) {
            return Err(KubeQuantityError::Fractional(text.to_string()));
        }
        value /= divisor;
    }
    value = value
        .checked_mul(1u128 << binary_shift)
        .ok_or_else(too_large)?;
    u64::try_from(value).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_forms_the_api_server_writes() {
        assert_eq!(parse_whole_quantity("1"), Ok(1));
        assert_eq!(parse_whole_quantity("3k"), Ok(3000));
        assert_eq!(parse_whole_quantity("4096"), Ok(4096));
        assert_eq!(parse_whole_quantity("1T"), Ok(1_000_000_000_000));
        assert_eq!(parse_whole_quantity("2Gi"), Ok(2 << 30));
        assert_eq!(parse_whole_quantity("1e3"), Ok(1000));
        assert_eq!(parse_whole_quantity("1E+3"), Ok(1000));
        assert_eq!(parse_whole_quantity("2.5k"), Ok(2500));
        assert_eq!(parse_whole_quantity("1000m"), Ok(1));
        assert_eq!(parse_whole_quantity("0"), Ok(0));
        assert_eq!(parse_whole_quantity("-0"), Ok(0));
        assert_eq!(parse_whole_quantity("+7"), Ok(7));
        assert_eq!(parse_whole_quantity("12."), Ok(12));
        assert_eq!(parse_whole_quantity("100"), Ok(100));
    }

    #[test]
    fn refuses_what_is_not_a_whole_count() {
        assert!(matches!(
            parse_whole_quantity("-1"),
            Err(KubeQuantityError::Negative(_))
        ));
        assert!(matches!(
            parse_whole_quantity("500m"),
            Err(KubeQuantityError::Fractional(_))
        ));
        assert!(matches!(
            parse_whole_quantity("0.5"),
            Err(KubeQuantityError::Fractional(_))
        ));
        assert!(matches!(
            parse_whole_quantity("1e-3"),
            Err(KubeQuantityError::Fractional(_))
        ));
        assert!(matches!(
            parse_whole_quantity("100E"),
            Err(KubeQuantityError::TooLarge(_))
        ));
        assert!(matches!(
            parse_whole_quantity("1e400"),
            Err(KubeQuantityError::TooLarge(_))
        ));
        assert!(matches!(
            parse_whole_quantity("99999999999999999999999999999999999999999"),
            Err(KubeQuantityError::TooLarge(_))
        ));
        for bad in [
            "abc", "1GB", "1 k", ".", "1.2.3", "e3", "1e", "1ee3", "--1", "0x10",
        ] {
            assert!(
                matches!(
                    parse_whole_quantity(bad),
                    Err(KubeQuantityError::Malformed(_))
                ),
                "{bad}"
            );
        }
        assert_eq!(parse_whole_quantity("  "), Err(KubeQuantityError::Empty));
    }
}
