//! System packages the tests need.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

/// What the tests need from the system: a Vulkan driver for the wgpu tests (on a machine
/// without a GPU, Mesa's lavapipe), tmux for the terminal test of `kiln chat`, and Python's
/// venv for the server suite. Installs
/// what is missing with apt-get when run as root on Debian/Ubuntu.
pub fn ensure_test_packages() -> Result<()> {
    let mut missing = Vec::new();
    if !has_vulkan_icd() {
        missing.extend(["mesa-vulkan-drivers", "libvulkan1"]);
    }
    if !on_path("tmux") {
        missing.push("tmux");
    }
    // The server suite runs pytest in a virtual environment; Debian splits venv out.
    let has_venv = Command::new("python3")
        .args(["-c", "import ensurepip, venv"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_venv {
        missing.push("python3-venv");
    }
    if missing.is_empty() {
        return Ok(());
    }
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root || !Path::new("/usr/bin/apt-get").exists() {
        bail!(
            "the tests need {}: install them (Debian/Ubuntu: `sudo apt-get install {}`)",
            missing.join(", "),
            missing.join(" ")
        );
    }
    eprintln!("installing {} for the tests...", missing.join(", "));
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend(&missing);
    if !(apt(&["update", "-qq"]) && apt(&install)) {
        bail!("apt-get could not install {}", missing.join(" "));
    }
    Ok(())
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
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
