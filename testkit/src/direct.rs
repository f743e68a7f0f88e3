//! The CUDA driver's own entry points, found in the loaded driver library's symbol table rather
//! than through the dynamic linker or `dlsym`: they bypass any interposition (a preloaded hook
//! answers both of those with its wrappers). Timing the two in one process measures what the
//! interposition costs without the noise of comparing separate runs.

use std::ffi::{CStr, c_int, c_void};
use std::path::PathBuf;

/// Address of `symbol` in the loaded library whose file name starts with `lib_prefix`
/// (e.g. `libcuda.so`).
pub fn loaded_symbol(lib_prefix: &str, symbol: &str) -> Result<*const c_void, String> {
    let (path, base) = loaded_library(lib_prefix)
        .ok_or_else(|| format!("no {lib_prefix}* is loaded in this process"))?;
    let bytes = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let value = dynamic_symbol_value(&bytes, symbol)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .ok_or_else(|| format!("{} defines no {symbol}", path.display()))?;
    Ok((base + value) as *const c_void)
}

/// Path and load address of the first loaded object whose file name starts with `prefix`.
fn loaded_library(prefix: &str) -> Option<(PathBuf, usize)> {
    struct Search<'a> {
        prefix: &'a str,
        found: Option<(PathBuf, usize)>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the `Search` passed below; `info` is valid during the callback.
        let (search, info) = unsafe { (&mut *(data as *mut Search), &*info) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: the loader's NUL-terminated name of this object.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_string_lossy();
        let path = PathBuf::from(name.as_ref());
        let matches = path
            .file_name()
            .is_some_and(|f| f.to_string_lossy().starts_with(search.prefix));
        if matches {
            search.found = Some((path, info.dlpi_addr as usize));
            return 1;
        }
        0
    }
    let mut search = Search {
        prefix,
        found: None,
    };
    // SAFETY: the callback only reads the loader's records and writes `search`.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search as *mut c_void) };
    search.found
}

/// `st_value` of a defined dynamic symbol of an ELF64 little-endian shared object.
fn dynamic_symbol_value(elf: &[u8], symbol: &str) -> Result<Option<usize>, String> {
    let u16_at = |o: usize| -> Result<u16, String> {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or_else(|| "truncated ELF file".to_string())
    };
    let u32_at = |o: usize| -> Result<u32, String> {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .ok_or_else(|| "truncated ELF file".to_string())
    };
    let u64_at = |o: usize| -> Result<usize, String> {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| "truncated ELF file".to_string())
    };
    const SHT_DYNSYM: u32 = 11;
    const SHN_UNDEF: u16 = 0;
    if elf.get(..6) != Some(b"\x7fELF\x02\x01") {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28)?, u16_at(0x3a)? as usize, u16_at(0x3c)?);
    for i in 0..shnum as usize {
        let sh = shoff + i * shentsize;
        if u32_at(sh + 4)? != SHT_DYNSYM {
            continue;
        }
        let (offset, size, link, entsize) = (
            u64_at(sh + 0x18)?,
            u64_at(sh + 0x20)?,
            u32_at(sh + 0x28)? as usize,
            u64_at(sh + 0x38)?,
        );
        let strtab = u64_at(shoff + link * shentsize + 0x18)?;
        for sym in (offset..offset + size).step_by(entsize.max(1)) {
            let name_at = strtab + u32_at(sym)? as usize;
            let name = elf
                .get(name_at..)
                .and_then(|s| CStr::from_bytes_until_nul(s).ok())
                .ok_or("bad symbol name")?;
            if name.to_bytes() == symbol.as_bytes() && u16_at(sym + 6)? != SHN_UNDEF {
                return Ok(Some(u64_at(sym + 8)?));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_loaded_library_function_past_the_dynamic_linker() {
        // libc's own `getpid`, found by file, is the function the dynamic linker resolves.
        let found = loaded_symbol("libc.so", "getpid").expect("libc is loaded");
        // SAFETY: dlsym with a NUL-terminated name.
        let linked = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) };
        assert_eq!(found, linked as *const c_void);
        assert!(loaded_symbol("libc.so", "no_such_symbol_here").is_err());
        assert!(loaded_symbol("libnot-loaded.so", "getpid").is_err());
    }
}
