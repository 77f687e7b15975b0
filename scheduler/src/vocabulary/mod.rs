//! The vocabulary of annotations and labels the extender reads and writes,
//! with pure readers of them. Leaf modules: they import nothing of the
//! crate but each other.

pub mod claims;
pub mod elastic;
pub mod kubeshare;
