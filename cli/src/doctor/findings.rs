//! What `vgpu doctor` found, section by section: each finding marked ok,
//! warn or fail, with what to do when it is wrong. The sections add to
//! them; the doctor writes them out.

use serde::Serialize;

/// The sections, in the order they are shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Section {
    Driver,
    Gpus,
    Dra,
    Shim,
    Monitor,
}

impl Section {
    pub(super) const ALL: [Self; 5] = [
        Self::Driver,
        Self::Gpus,
        Self::Dra,
        Self::Shim,
        Self::Monitor,
    ];

    pub(super) fn title(self) -> &'static str {
        match self {
            Self::Driver => "Driver (NVML)",
            Self::Gpus => "GPUs, as the device plugin publishes them",
            Self::Dra => "DRA: the ResourceSlice vgpu-dra would publish",
            Self::Shim => "Shim: a CUDA program under a cap",
            Self::Monitor => "Node monitor",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    pub(super) fn marker(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
        }
    }
}

/// One thing found, and what to do about it when it is wrong.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub section: Section,
    pub status: Status,
    pub message: String,
    /// Further lines that belong to the message (a device's capacities).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub details: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

/// The findings of one run, in the order found.
#[derive(Debug, Default)]
pub struct Findings(pub(super) Vec<Finding>);

impl Findings {
    pub fn ok(&mut self, section: Section, message: impl Into<String>) -> &mut Finding {
        self.push(section, Status::Ok, message.into(), None)
    }

    pub fn warn(
        &mut self,
        section: Section,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> &mut Finding {
        self.push(section, Status::Warn, message.into(), Some(hint.into()))
    }

    pub fn fail(
        &mut self,
        section: Section,
        message: impl Into<String>,
        hint: impl Into<String>,
    ) -> &mut Finding {
        self.push(section, Status::Fail, message.into(), Some(hint.into()))
    }

    fn push(
        &mut self,
        section: Section,
        status: Status,
        message: String,
        hint: Option<String>,
    ) -> &mut Finding {
        let at = self.0.len();
        self.0.push(Finding {
            section,
            status,
            message,
            details: Vec::new(),
            hint,
        });
        &mut self.0[at]
    }

    pub(super) fn count(&self, status: Status) -> usize {
        self.0.iter().filter(|f| f.status == status).count()
    }
}

/// Bytes as whole MiB (rounded down, as nvidia-smi shows them).
pub fn mib(bytes: u64) -> u64 {
    bytes >> 20
}
