//! Diagnostics to stderr, only when `GPUSHARE_LOG` is set: the hook is a guest and stays quiet.

use std::sync::OnceLock;

pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var_os("GPUSHARE_LOG").is_some_and(|v| !v.is_empty() && v != "off")
    })
}

macro_rules! debug {
    ($($arg:tt)*) => {
        if $crate::log::enabled() {
            eprintln!("gpushare[{}]: {}", std::process::id(), format_args!($($arg)*));
        }
    };
}
pub(crate) use debug;
