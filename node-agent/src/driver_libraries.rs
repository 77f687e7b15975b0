//! The names programs load the NVIDIA driver's libraries by.

/// CUDA's driver library and NVML, each by its versioned name and its
/// development name. Where the simulated GPU stands in for the driver
/// (`vgpu demo`, the tests' sandboxes) it is linked under every one of
/// them, so that whichever a program asks the dynamic loader for, it finds
/// the simulation and one shared state.
pub const DRIVER_LIBRARIES: [&str; 4] = [
    "libcuda.so.1",
    "libcuda.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml.so",
];
