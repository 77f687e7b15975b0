//! The test kit's own tests and the workspace's module-graph check, in one
//! test binary (each release test binary costs a thin-LTO link of its own).

mod api_server;
mod front_page;
mod module_graph;
