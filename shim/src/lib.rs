//! libvgpu.so
