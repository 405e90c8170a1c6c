//! System packages the tests need.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

/// The wgpu tests need a Vulkan driver; on a machine without a GPU that is Mesa's lavapipe.
pub fn ensure_vulkan_driver() -> Result<()> {
    if has_vulkan_icd() {
        return Ok(());
    }
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root || !Path::new("/usr/bin/apt-get").exists() {
        bail!(
            "no Vulkan driver found for the wgpu tests: install Mesa's lavapipe \
             (Debian/Ubuntu: `sudo apt-get install mesa-vulkan-drivers`)"
        );
    }
    eprintln!("installing Mesa's Vulkan drivers (lavapipe) for the wgpu tests...");
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !(apt(&["update", "-qq"])
        && apt(&["install", "-y", "-qq", "mesa-vulkan-drivers", "libvulkan1"]))
    {
        bail!("apt-get could not install mesa-vulkan-drivers");
    }
    Ok(())
}

fn has_vulkan_icd() -> bool {
    let icd = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d"]
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .any(|entry| entry.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json")));
    let loader = [
        "/usr/lib/x86_64-linux-gnu/libvulkan.so.1",
        "/usr/lib/aarch64-linux-gnu/libvulkan.so.1",
        "/usr/lib/libvulkan.so.1",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    icd && loader
}
