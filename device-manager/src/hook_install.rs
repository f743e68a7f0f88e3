//! Puts `libgpushare.so` where containers can mount it: a versioned host directory
//! `<root>/<crate version>-<first 12 hex digits of the library's SHA-256>/`, created once and
//! never written again. A running container maps the library from its directory; replacing
//! that file in place would crash it (HAMi's upgrade failure), so a new library always gets a
//! new directory, made complete under a temporary name and renamed into place.

use crate::injection::HOOK_MOUNT;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The library's file name in the versioned directory (and in the container).
pub const LIBRARY: &str = "libgpushare.so";

/// Install `library` under `root`; returns the versioned directory (existing or new).
pub fn install(library: &Path, root: &Path) -> Result<PathBuf, String> {
    let bytes = std::fs::read(library).map_err(|e| {
        format!(
            "cannot read the hook {}: {e}; pass --hook-library with the path of libgpushare.so",
            library.display()
        )
    })?;
    let digest = Sha256::digest(&bytes);
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    let version = format!("{}-{hex}", env!("CARGO_PKG_VERSION"));
    let dir = root.join(&version);
    if dir.join(LIBRARY).is_file() {
        return Ok(dir);
    }
    let fail = |what: &str, p: &Path, e: std::io::Error| {
        format!(
            "cannot {what} {}: {e}; check that --hook-dir is a writable host directory",
            p.display()
        )
    };
    std::fs::create_dir_all(root).map_err(|e| fail("create", root, e))?;
    let tmp = root.join(format!(".{version}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| fail("create", &tmp, e))?;
    std::fs::write(tmp.join(LIBRARY), &bytes).map_err(|e| fail("write", &tmp, e))?;
    // For `--preload ld-so-preload`: the file mounted over the container's /etc/ld.so.preload.
    std::fs::write(
        tmp.join("ld.so.preload"),
        format!("{HOOK_MOUNT}/{LIBRARY}\n"),
    )
    .map_err(|e| fail("write", &tmp, e))?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another manager (an overlapping restart) installed the same version first.
        Err(_) if dir.join(LIBRARY).is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(fail("rename into", &dir, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_new_library_gets_a_new_directory_and_an_old_one_is_never_rewritten() {
        let t = tempfile::tempdir().unwrap();
        let lib = t.path().join("libgpushare.so");
        std::fs::write(&lib, b"version one").unwrap();
        let root = t.path().join("lib");
        let d1 = install(&lib, &root).unwrap();
        let inode = std::fs::metadata(d1.join(LIBRARY)).unwrap().ino();
        assert_eq!(
            install(&lib, &root).unwrap(),
            d1,
            "same library, same directory"
        );
        assert_eq!(
            std::fs::metadata(d1.join(LIBRARY)).unwrap().ino(),
            inode,
            "not rewritten"
        );
        std::fs::write(&lib, b"version two").unwrap();
        let d2 = install(&lib, &root).unwrap();
        assert_ne!(d1, d2);
        assert_eq!(std::fs::read(d1.join(LIBRARY)).unwrap(), b"version one");
        assert_eq!(std::fs::read(d2.join(LIBRARY)).unwrap(), b"version two");
        assert_eq!(
            std::fs::read_to_string(d2.join("ld.so.preload")).unwrap(),
            "/usr/lib/gpushare/libgpushare.so\n"
        );
        let leftovers: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")
            })
            .collect();
        assert!(leftovers.is_empty());
        assert!(
            install(&t.path().join("missing.so"), &root)
                .unwrap_err()
                .contains("--hook-library")
        );
    }
}
