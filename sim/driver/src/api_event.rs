//! Events: records are zero-duration stream ops; their device completion time is the event's
//! timestamp, so `cuEventElapsedTime` measures device time exactly. The device posts it on the
//! event board as soon as it is decided: queries read memory, as on a real GPU.

use crate::ffi::*;
use crate::state::{Driver, Event, State, driver, with_state};
use gpushare_sim_wire::{Op, OpRef};
use std::ffi::c_uint;

entry!(
    fn cuEventCreate(ph: *mut Handle, flags: c_uint) {
        if flags & !(CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS) != 0
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_state(|d, st| {
            let ctx = st.current()?;
            let slot = st
                .take_event_slot(d.client.events.slots())
                .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
            let e = st.new_id();
            st.events.insert(
                e,
                Event {
                    ctx,
                    flags,
                    slot,
                    ..Event::default()
                },
            );
            put(ph, handle(e))
        })
    }
);

fn destroy(h: Handle) -> CuResult {
    with_state(|d, st| {
        let ev = st.events.remove(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        st.free_event_slot(ev.slot);
        // Other processes may no longer open it ("operations on the imported event after the
        // exported event has been freed" are undefined).
        if let (Some(event), true) = (ev.shared, ev.exported) {
            d.client
                .send(&gpushare_sim_wire::Request::UnshareEvent { event })?;
        }
        Ok(())
    })
}

entry!(
    fn cuEventDestroy(h: Handle) {
        destroy(h)
    }
);
entry!(
    fn cuEventDestroy_v2(h: Handle) {
        destroy(h)
    }
);

fn record(h: Handle, stream: Handle, pt: bool) -> CuResult {
    with_state(|d, st| {
        let s = st.resolve_stream(&d.client, stream, pt)?;
        record_on(d, st, id(h), s, &[])
    })
}

/// Record `event` on `stream` after the stream's work and `after` (a green context's record
/// waits for all of its streams); into the graph instead while the stream is captured.
pub fn record_on(d: &Driver, st: &mut State, event: u64, stream: u64, after: &[OpRef]) -> CuResult {
    if !st.events.contains_key(&event) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if let Some(cap) = st.streams[&stream].capture.clone() {
        if cap.invalidated {
            return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        let ev = st.events.get_mut(&event).expect("checked above");
        ev.captured = Some(cap);
        return Ok(());
    }
    // A generation never used before on any slot: a slot's next owner cannot read this
    // record's time as its own.
    let generation = st.new_id();
    let (slot, shared) = (st.events[&event].slot, st.events[&event].shared);
    let op = match shared {
        Some(event) => Op::SharedEvent {
            slot,
            generation,
            event,
        },
        None => Op::Event { slot, generation },
    };
    let r = st.submit(&d.client, stream, op, after)?;
    let ev = st.events.get_mut(&event).expect("checked above");
    ev.record = Some(r);
    ev.generation = generation;
    ev.done_ns = None;
    ev.captured = None;
    if shared.is_some() {
        // The record is the shared event's latest for every process once this call returns:
        // a round trip on this connection has the device take it before anything another
        // process does after hearing of it.
        d.client.query(Vec::new())?;
    }
    Ok(())
}

/// The op that makes work wait for `event`'s latest record: a marker after the record, or,
/// for an event shared between processes, a marker the device makes wait for the latest
/// record of the event by any process. `None`: nothing to wait for.
pub fn wait_op(ev: &Event) -> Option<(Op, Vec<OpRef>)> {
    match (ev.shared, ev.record) {
        (Some(event), _) => Some((Op::WaitShared { event }, Vec::new())),
        (None, Some(r)) => Some((Op::Marker, vec![r])),
        (None, None) => None,
    }
}

entry_pt!(cuEventRecord / cuEventRecord_ptsz, |pt| fn(h: Handle, stream: Handle) { record(h, stream, pt) });

entry_pt!(cuEventRecordWithFlags / cuEventRecordWithFlags_ptsz, |pt| fn(h: Handle, stream: Handle, _flags: c_uint) {
    record(h, stream, pt)
});

/// The event's completion time if it has completed (`Some(0)` for a never-recorded event, which
/// counts as complete), `None` while pending; `wait` blocks until it completes.
fn completion(h: Handle, wait: bool) -> CuResult<u64> {
    let d = driver()?;
    let (rec, slot, generation) = {
        let mut st = d.lock();
        let ev = st.events.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(event) = ev.shared {
            drop(st);
            return match d.client.shared_event_status(event, wait)? {
                Some(t) => Ok(t),
                None => Err(CUDA_ERROR_NOT_READY),
            };
        }
        // An event recorded in a capture stands for no device work: querying or waiting for
        // it while the capture goes on is invalid and invalidates the capture.
        if let Some(graph) = ev.captured.as_ref().map(|c| c.graph)
            && st.capture_active(graph)
        {
            st.invalidate_capture(graph);
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let ev = &st.events[&id(h)];
        match (ev.done_ns, ev.record) {
            (Some(t), _) => return Ok(t),
            (None, None) => return Ok(0),
            (None, Some(r)) => (r, ev.slot, ev.generation),
        }
    };
    let end = if let Some(end) = d.client.events.read(slot, generation) {
        // The device said when: no round trip (wait out a completion still ahead).
        let now = gpushare_units::monotonic_ns();
        if end > now {
            if !wait {
                return Err(CUDA_ERROR_NOT_READY);
            }
            std::thread::sleep(std::time::Duration::from_nanos(end - now));
        }
        end
    } else if wait {
        d.client.wait(vec![rec])?
    } else {
        d.client
            .query(vec![rec])?
            .first()
            .copied()
            .flatten()
            .ok_or(CUDA_ERROR_NOT_READY)?
    };
    let mut st = d.lock();
    if let Some(ev) = st.events.get_mut(&id(h))
        && ev.record == Some(rec)
    {
        ev.done_ns = Some(end);
    }
    Ok(end)
}

entry!(
    fn cuEventQuery(h: Handle) {
        completion(h, false).map(|_| ())
    }
);
entry!(
    fn cuEventSynchronize(h: Handle) {
        completion(h, true)?;
        crate::api_memory::release_pools_at_sync()
    }
);

fn elapsed(ms: *mut f32, start: Handle, end: Handle) -> CuResult {
    {
        let d = driver()?;
        let st = d.lock();
        for h in [start, end] {
            let ev = st.events.get(&id(h)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if ev.flags & CU_EVENT_DISABLE_TIMING != 0 || ev.record.is_none() {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
        }
    }
    let t0 = completion(start, false)?;
    let t1 = completion(end, false)?;
    put(ms, (t1 as f64 - t0 as f64) as f32 / 1e6)
}

entry!(
    fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) {
        elapsed(ms, start, end)
    }
);
entry!(
    fn cuEventElapsedTime_v2(ms: *mut f32, start: Handle, end: Handle) {
        elapsed(ms, start, end)
    }
);
