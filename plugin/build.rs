//! Compiles kubelet's device plugin API (`proto/api.proto`, v1beta1) and
//! the part of its PodResources API the plugin reads
//! (`proto/podresources.proto`, v1) into Rust with `protox` (a protobuf
//! compiler in pure Rust, so no `protoc` is needed) and `tonic-prost-build`
//! (client and server stubs).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/api.proto");
    println!("cargo:rerun-if-changed=proto/podresources.proto");
    let descriptors = protox::compile(["api.proto", "podresources.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
