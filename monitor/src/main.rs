//! `vgpu-monitor`: not implemented yet. The binary exists so the workspace and
//! the deployment layout are in place; it refuses to run rather than pretend.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("vgpu-monitor is not implemented yet in this release of vgpu")
}
