//! A small disk of the test's own: a tmpfs mounted over a directory, to fill on purpose.

/// A small tmpfs mounted over a directory for the test's duration (unmounted on drop, also on panic).
pub struct SmallDisk(pub std::path::PathBuf);

impl SmallDisk {
    pub fn mount(dir: &std::path::Path, size: &str) -> SmallDisk {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a small tmpfs (as root, as CI runs): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallDisk(dir.to_path_buf())
    }

    /// Fills the disk until it refuses more bytes.
    pub fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.0.join("filler")).unwrap();
        let block = vec![0u8; 1024];
        while f.write_all(&block).is_ok() {}
        let _ = f.sync_all();
    }

    pub fn free(&self) {
        std::fs::remove_file(self.0.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}
