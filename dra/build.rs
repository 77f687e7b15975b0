//! Compiles kubelet's DRA plugin API (`proto/dra.proto`, v1) and its plugin
//! registration API (`proto/pluginregistration.proto`, v1) with `protox`
//! (pure Rust, no `protoc`) and `tonic-prost-build` (client stubs for the
//! tests, server stubs for the driver).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/dra.proto");
    println!("cargo:rerun-if-changed=proto/pluginregistration.proto");
    let descriptors = protox::compile(["dra.proto", "pluginregistration.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
