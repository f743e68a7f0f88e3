//! What this process reserves at the scheduler: every allocation draws its bytes from the
//! GPU's [`Lease`](crate::lease::Lease) (a round trip only when the lease must grow), every
//! free puts them back, and a thread of its own (`gpushare-mem`, started on first need) gives
//! back, once per [`LEASE_WINDOW`], the spare no allocation needed in the window; it sleeps
//! without a timeout while the process holds no spare.
//!
//! Without a scheduler, fail-open grants everything unchecked (and counts it, so a restated
//! holding after the reconnection is whole) and fail-closed waits for it; a refused process
//! allocates nothing.

use crate::lease::{Refused, Take};
use crate::log::debug;
use crate::process::Hook;
use crate::settings::FailPolicy;
use gpushare_protocol::{ClientMsg, ServerMsg};
use std::time::Duration;

/// Spare that no allocation needed for this long goes back to the scheduler: another process
/// of the group waits at most about twice this for bytes an idle process leased.
pub const LEASE_WINDOW: Duration = Duration::from_millis(20);

/// Reserve `bytes` for an allocation on gate `gpu`; false: over the cap (or refused).
pub fn draw(h: &'static Hook, gpu: usize, bytes: u64) -> bool {
    let take = h.memory.lease(gpu).take(bytes);
    let Take::Ask(mut a) = take else {
        return true;
    };
    loop {
        let granted = ask(h, gpu, a.ask);
        let mut lease = h.memory.lease(gpu);
        if granted {
            let back = lease.granted(&a);
            let spare = lease.spare();
            drop(lease);
            give_back(h, gpu, back);
            if spare > 0 {
                keep(h);
            }
            return true;
        }
        match lease.refused(&a) {
            Refused::Retry(next) => a = next,
            Refused::Failed { give_back: back } => {
                drop(lease);
                give_back(h, gpu, back);
                return false;
            }
        }
    }
}

/// Allocations of `bytes` on gate `gpu` ended (freed, or failed by the driver after their
/// reservation).
pub fn release(h: &'static Hook, gpu: usize, bytes: u64) {
    let mut lease = h.memory.lease(gpu);
    let back = lease.free(bytes);
    let spare = lease.spare();
    drop(lease);
    give_back(h, gpu, back);
    if spare > 0 {
        keep(h);
    }
}

/// The scheduler told the group's cap on gate `gpu` (`None`: uncapped): the lease block
/// follows it.
pub fn learn_cap(h: &Hook, gpu: usize, cap: Option<u64>) {
    let block = h.memory.block_for(cap);
    let back = h.memory.lease(gpu).set_block(block);
    give_back(h, gpu, back);
}

/// Bytes this process holds on gate `gpu` that it has not allocated: free for it, though the
/// scheduler counts them as the group's.
pub fn spare(h: &Hook, gpu: usize) -> u64 {
    h.memory.lease(gpu).spare()
}

/// One reservation round trip: granted or not. Without a scheduler, fail-open grants
/// unchecked and fail-closed waits for it (and refuses if it does not answer).
fn ask(h: &Hook, gpu: usize, bytes: u64) -> bool {
    if !h.wait_connected() {
        return !h.port.is_refused();
    }
    let uuid = h.gates[gpu].uuid;
    match h.port.call(|req| ClientMsg::MemReserve {
        req,
        gpu: uuid,
        bytes,
    }) {
        Some(ServerMsg::Memory { granted, cap, .. }) => {
            learn_cap(h, gpu, cap);
            granted
        }
        _ => h.settings.fail == FailPolicy::Open,
    }
}

fn give_back(h: &Hook, gpu: usize, bytes: u64) {
    if bytes > 0 {
        h.port.send(&ClientMsg::MemFree {
            gpu: h.gates[gpu].uuid,
            bytes,
        });
    }
}

/// The process holds spare: make sure the keeper thread will give it back if unused.
fn keep(h: &'static Hook) {
    h.memory.keeper.start_once(|| {
        let spawned = std::thread::Builder::new()
            .name("gpushare-mem".into())
            .spawn(move || h.memory.keeper.run(LEASE_WINDOW, || tick(h)));
        if let Err(e) = spawned {
            debug!("no memory keeper thread ({e}): leased spare stays until freed");
        }
    });
    h.memory.keeper.ring();
}

/// One window of the keeper: the spare each lease did not need goes back. Whether any spare
/// is left to watch.
fn tick(h: &Hook) -> bool {
    let mut busy = false;
    for gpu in 0..h.memory.gpus() {
        let mut lease = h.memory.lease(gpu);
        let back = lease.expire();
        busy |= lease.spare() > 0;
        drop(lease);
        give_back(h, gpu, back);
    }
    busy
}
