//! Simulated GPU.
