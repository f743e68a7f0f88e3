//! Compiles the vendored kubelet protos (device plugin v1beta1, pod resources v1, plugin
//! registration v1, DRA v1) with `protox`, a pure-Rust protobuf compiler, so no `protoc` is
//! needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/deviceplugin/v1beta1/api.proto",
        "proto/podresources/v1/api.proto",
        "proto/pluginregistration/v1/api.proto",
        "proto/dra/v1/api.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
