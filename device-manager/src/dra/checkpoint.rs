//! The claims prepared on this node, on disk (`<plugin-dir>/checkpoint.json`): a restarted
//! driver answers the kubelet's repeated prepares and unprepares as before, and gives the
//! containers of prepared claims their groups again. Written whole before the kubelet is
//! answered (a temporary file, synced, renamed into place).

use super::claim::PreparedClaim;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// The file's format version.
const VERSION: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub version: u32,
    /// By claim UID.
    pub claims: BTreeMap<String, PreparedClaim>,
}

impl Checkpoint {
    /// Read `path`; none yet is an empty checkpoint. The error says what to do.
    pub fn load(path: &Path) -> Result<Checkpoint, String> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Checkpoint {
                    version: VERSION,
                    ..Default::default()
                });
            }
            Err(e) => {
                return Err(format!(
                    "cannot read the checkpoint {}: {e}",
                    path.display()
                ));
            }
        };
        let c: Checkpoint = serde_json::from_slice(&bytes).map_err(|e| {
            format!(
                "the checkpoint {} is unreadable ({e}): move it away to start without the claims it lists (delete their pods so that they are prepared again)",
                path.display()
            )
        })?;
        if c.version != VERSION {
            return Err(format!(
                "the checkpoint {} has version {}, this driver reads version {VERSION}: run the driver version that wrote it, or move it away and delete the pods of its claims",
                path.display(),
                c.version
            ));
        }
        Ok(c)
    }

    /// Write to `path`, replacing what is there only once complete.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let fail = |e: std::io::Error| {
            format!(
                "cannot write the checkpoint {}: {e}; check that --plugin-dir is writable",
                path.display()
            )
        };
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(self).expect("a checkpoint serialises");
        std::fs::File::create(&tmp)
            .and_then(|mut f| f.write_all(&text).and_then(|_| f.sync_all()))
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(fail)?;
        if let Some(dir) = path.parent() {
            // The rename itself is durable once the directory is synced.
            let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_saved_is_loaded_and_damage_is_explained() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("checkpoint.json");
        let mut c = Checkpoint::load(&path).unwrap();
        assert!(c.claims.is_empty());
        c.claims.insert(
            "u1".into(),
            PreparedClaim {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
                devices: vec![],
                share_units: 30,
                memory: 4 << 30,
                limit: 0.6,
                weight: 2.0,
            },
        );
        c.save(&path).unwrap();
        assert_eq!(Checkpoint::load(&path).unwrap(), c);
        std::fs::write(&path, b"{\"version\": 1, \"claims\": {").unwrap();
        assert!(
            Checkpoint::load(&path)
                .unwrap_err()
                .contains("move it away")
        );
        std::fs::write(&path, b"{\"version\": 7, \"claims\": {}}").unwrap();
        assert!(Checkpoint::load(&path).unwrap_err().contains("version 7"));
    }
}
