//! The CDI devices of prepared claims (Container Device Interface: the container runtime reads
//! spec files from `--cdi-dir` and applies a device's edits to each container the kubelet
//! names it for). One spec file per claim, `gpushare.io-claim_<uid>.json`, with one device,
//! `gpushare.io/claim=<uid>`, whose edits are what the device plugin's `Allocate` gives a
//! container ([`crate::injection`]). Files are written whole (a temporary file renamed into
//! place), so the runtime never reads half a spec.

use crate::injection::ContainerEdits;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The CDI kind of the claims' devices.
pub const KIND: &str = "gpushare.io/claim";
/// The CDI specification version written: the oldest with everything used (env, mounts).
const CDI_VERSION: &str = "0.5.0";
const PREFIX: &str = "gpushare.io-claim_";

/// The fully qualified CDI device name of claim `uid`.
pub fn device_id(uid: &str) -> String {
    format!("{KIND}={uid}")
}

/// The spec file of claim `uid`.
pub fn spec_path(dir: &Path, uid: &str) -> PathBuf {
    dir.join(format!("{PREFIX}{uid}.json"))
}

/// The spec of claim `uid`'s device.
pub fn spec(uid: &str, edits: &ContainerEdits) -> Value {
    let env: Vec<String> = edits.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mounts: Vec<Value> = edits
        .mounts
        .iter()
        .map(|m| {
            let mut options = vec!["bind", "nosuid", "nodev"];
            if m.read_only {
                options.insert(0, "ro");
            }
            json!({"hostPath": m.host_path, "containerPath": m.container_path, "options": options})
        })
        .collect();
    json!({
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [{"name": uid, "containerEdits": {"env": env, "mounts": mounts}}],
    })
}

/// Write claim `uid`'s spec into `dir`.
pub fn write(dir: &Path, uid: &str, edits: &ContainerEdits) -> Result<(), String> {
    let path = spec_path(dir, uid);
    let fail = |e: std::io::Error| {
        format!(
            "cannot write the CDI spec {}: {e}; check that --cdi-dir is the host's CDI directory, mounted writable",
            path.display()
        )
    };
    std::fs::create_dir_all(dir).map_err(fail)?;
    let tmp = dir.join(format!(".{PREFIX}{uid}.{}.tmp", std::process::id()));
    let text = serde_json::to_vec_pretty(&spec(uid, edits)).expect("a JSON value");
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(&text).and_then(|_| f.sync_all()))
        .and_then(|_| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    Ok(())
}

/// Remove claim `uid`'s spec (none is fine).
pub fn remove(dir: &Path, uid: &str) -> Result<(), String> {
    let path = spec_path(dir, uid);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!(
            "cannot remove the CDI spec {}: {e}",
            path.display()
        )),
    }
}

/// The claims whose spec files are in `dir`.
pub fn claims_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            Some(
                name.strip_prefix(PREFIX)?
                    .strip_suffix(".json")?
                    .to_string(),
            )
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::injection::{Injection, Preload};

    #[test]
    fn a_claims_spec_carries_the_edits_and_is_removed_with_it() {
        let t = tempfile::tempdir().unwrap();
        let inj = Injection {
            tenant_socket: "/run/gpushare/gpushare.sock".into(),
            hook_dir: "/var/lib/gpushare/lib/0.1.0-abc".into(),
            preload: Preload::LdPreload,
            cdi_kind: None,
        };
        let uid = "0b1c8e3a-6f0e-4a57-9a39-8f2d3c1b7e11";
        let edits = inj.edits(&["GPU-00000000-0000-0000-0000-00000000000a".into()]);
        write(t.path(), uid, &edits).unwrap();
        let s: Value =
            serde_json::from_slice(&std::fs::read(spec_path(t.path(), uid)).unwrap()).unwrap();
        assert_eq!(s["kind"], KIND);
        let d = &s["devices"][0];
        assert_eq!(d["name"], uid);
        let env: Vec<&str> = d["containerEdits"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(env.contains(&"NVIDIA_VISIBLE_DEVICES=GPU-00000000-0000-0000-0000-00000000000a"));
        assert!(env.contains(&"GPUSHARE_SOCKET=/run/gpushare/gpushare.sock"));
        assert!(env.contains(&"LD_PRELOAD=/usr/lib/gpushare/libgpushare.so"));
        assert!(
            d["containerEdits"]["mounts"]
                .as_array()
                .unwrap()
                .contains(&json!({"hostPath": "/var/lib/gpushare/lib/0.1.0-abc",
                    "containerPath": "/usr/lib/gpushare", "options": ["ro", "bind", "nosuid", "nodev"]}))
        );
        assert_eq!(device_id(uid), format!("gpushare.io/claim={uid}"));
        std::fs::write(t.path().join("other-vendor.json"), "{}").unwrap();
        assert_eq!(claims_in(t.path()), [uid]);
        remove(t.path(), uid).unwrap();
        remove(t.path(), uid).unwrap();
        assert!(claims_in(t.path()).is_empty());
    }
}
