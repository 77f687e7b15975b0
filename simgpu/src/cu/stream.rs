//! Streams and events on the real-time timeline.
//!
//! A stream knows when its last queued work ends (`last_end`); an event
//! records that time; synchronising sleeps until it. In wall timing a
//! stream knows its last operation on its device's thread (`last_seq`); an
//! event is stamped when the device thread reaches it; synchronising waits
//! until the device thread has passed the operation.
//!
//! While a stream is capturing (see [`super::graph`]), synchronising or
//! querying it fails with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
//! invalidates the capture, like the real driver. Event record and wait are
//! how captures fork and join: recording on a capturing stream marks the
//! event as captured (no node, no time); a stream that waits on such an
//! event joins the capture. With `CU_EVENT_RECORD_EXTERNAL` /
//! `CU_EVENT_WAIT_EXTERNAL` they become event-record / wait-event nodes that
//! act when the graph runs.

use std::ffi::{c_int, c_uint};

use vgpu_cuda_abi::cuda::*;

use super::out;
use crate::clock;
use crate::driver::{
    self, check_init, lock, new_handle, Event, Inner, NodeOp, Stream, StreamRef, Timeline,
};
use crate::executor::{executor, Op};

const STREAM_FLAGS: c_uint = 0x1; // CU_STREAM_NON_BLOCKING
const EVENT_FLAGS: c_uint = 0xf; // BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS
const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// Stream priorities: 0 is the lowest, -5 the greatest (like an H100).
const PRIORITY_LEAST: c_int = 0;
const PRIORITY_GREATEST: c_int = -5;

fn create(ph: *mut CUstream, flags: c_uint, priority: c_int) -> Result<(), CUresult> {
    check_init()?;
    if ph.is_null() || flags & !STREAM_FLAGS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (ctx, _) = inner.current()?;
    let handle = new_handle();
    inner.streams.insert(
        handle,
        Stream {
            ctx,
            flags,
            priority: priority.clamp(PRIORITY_GREATEST, PRIORITY_LEAST),
            timeline: Timeline::default(),
            capture: None,
        },
    );
    // SAFETY: C API out-pointer, checked non-NULL.
    unsafe { out(ph, handle as CUstream) }
}

cuda_fn! {
    fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) {
        create(ph, flags, PRIORITY_LEAST)
    }
}

cuda_fn! {
    fn cuStreamCreateWithPriority(ph: *mut CUstream, flags: c_uint, priority: c_int) {
        create(ph, flags, priority)
    }
}

cuda_fn! {
    fn cuStreamDestroy_v2(stream: CUstream) {
        check_init()?;
        let mut inner = lock();
        let s = inner
            .streams
            .remove(&(stream as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if let Some(id) = s.capture {
            inner.invalidate_capture(id);
            if inner.captures.get(&id).is_some_and(|c| c.origin == stream as u64) {
                inner.end_capture(id);
            }
        }
        Ok(())
    }
}

/// Where the stream's queued work ends: when (timeline timing) or as which
/// operation of its device's thread (wall timing), and the device it runs
/// on. A capturing stream cannot be waited for: its capture is invalidated.
fn stream_end(stream: CUstream) -> Result<(u64, usize), CUresult> {
    check_init()?;
    let mut inner = lock();
    let (sref, _, device) = inner.stream(stream)?;
    if let Some(id) = inner.capture_of(sref) {
        inner.invalidate_capture(id);
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    let end = inner.timeline(sref).map_or(0, |t| {
        if driver::wall_timing() {
            t.last_seq
        } else {
            t.last_end
        }
    });
    Ok((end, device))
}

/// Waits for `stream`'s work when launches block (`CUDA_LAUNCH_BLOCKING=1`):
/// called by every launch after its work was queued, never on a capturing
/// stream (its work does not run).
pub(crate) fn finish_if_blocking(stream: CUstream) -> Result<(), CUresult> {
    match crate::config::get() {
        Ok(cfg) if cfg.launch_blocking => synchronize(stream),
        _ => Ok(()),
    }
}

fn synchronize(stream: CUstream) -> Result<(), CUresult> {
    let (end, device) = stream_end(stream)?;
    if driver::wall_timing() {
        if let Some(device_thread) = executor(device) {
            device_thread.wait_for(end);
        }
    } else {
        driver::wait_until(end);
    }
    lock().trim_pools_to_threshold(Some(device));
    Ok(())
}

twin!(cuStreamSynchronize, cuStreamSynchronize_ptsz, (stream: CUstream) {
    synchronize(stream)
});

twin!(cuStreamQuery, cuStreamQuery_ptsz, (stream: CUstream) {
    let (end, device) = stream_end(stream)?;
    let done = if driver::wall_timing() {
        executor(device).is_none_or(|device_thread| device_thread.is_done(end))
    } else {
        end <= clock::now_ns()
    };
    if done {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_READY)
    }
});

fn wait_event(stream: CUstream, event: CUevent, flags: c_uint) -> Result<(), CUresult> {
    check_init()?;
    if flags & !CU_EVENT_WAIT_EXTERNAL != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = lock();
    let (sref, _, device) = inner.stream(stream)?;
    let ev = inner
        .events
        .get(&(event as u64))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    let (time, captured, pending) = (ev.time, ev.captured, ev.pending);
    let capture = inner.capture_of(sref);
    if let Some(id) = capture {
        if flags & CU_EVENT_WAIT_EXTERNAL != 0 {
            return inner.capture_append(id, NodeOp::EventWait(event as u64));
        }
        // A join inside the capture (or a wait on outside work, which the
        // simulation treats as already satisfied): ordering only, no node.
        return match inner.captures.get(&id) {
            Some(c) if c.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
            _ => Ok(()),
        };
    }
    if let Some(id) = captured {
        // Fork: the waiting stream joins the capture the event belongs to.
        if let (StreamRef::Created(h), true) = (sref, inner.captures.contains_key(&id)) {
            if let Some(s) = inner.streams.get_mut(&h) {
                s.capture = Some(id);
            }
            return Ok(());
        }
    }
    if let Some((event_device, seq)) = pending {
        // Wall timing: work queued on one device runs in the order it was
        // queued, so only another device's event needs a wait.
        if event_device != device {
            let device_thread = executor(device).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
            let wait = device_thread.submit(Op::Wait {
                device: event_device,
                seq,
            })?;
            if let Some(timeline) = inner.timeline(sref) {
                timeline.last_seq = wait;
            }
        }
        return Ok(());
    }
    if let (Some(t), Some(timeline)) = (time, inner.timeline(sref)) {
        timeline.last_end = timeline.last_end.max(t);
    }
    Ok(())
}

twin!(cuStreamWaitEvent, cuStreamWaitEvent_ptsz, (stream: CUstream, event: CUevent, flags: c_uint) {
    wait_event(stream, event, flags)
});

twin!(cuStreamGetCtx, cuStreamGetCtx_ptsz, (stream: CUstream, pctx: *mut CUcontext) {
    check_init()?;
    let (_, ctx, _) = lock().stream(stream)?;
    // SAFETY: C API out-pointer.
    unsafe { out(pctx, ctx as CUcontext) }
});

twin!(cuStreamIsCapturing, cuStreamIsCapturing_ptsz, (stream: CUstream, status: *mut CUstreamCaptureStatus) {
    check_init()?;
    let (st, _) = capture_status(stream)?;
    // SAFETY: C API out-pointer.
    unsafe { out(status, st) }
});

twin!(cuStreamGetPriority, cuStreamGetPriority_ptsz, (stream: CUstream, priority: *mut c_int) {
    check_init()?;
    let inner = lock();
    let p = match inner.stream(stream)?.0 {
        StreamRef::Default(_) => PRIORITY_LEAST,
        StreamRef::Created(h) => inner.streams.get(&h).map_or(PRIORITY_LEAST, |s| s.priority),
    };
    // SAFETY: C API out-pointer.
    unsafe { out(priority, p) }
});

twin!(cuStreamGetFlags, cuStreamGetFlags_ptsz, (stream: CUstream, flags: *mut c_uint) {
    check_init()?;
    let inner = lock();
    let f = match inner.stream(stream)?.0 {
        StreamRef::Default(_) => 0,
        StreamRef::Created(h) => inner.streams.get(&h).map_or(0, |s| s.flags),
    };
    // SAFETY: C API out-pointer.
    unsafe { out(flags, f) }
});

cuda_fn! {
    fn cuEventCreate(ph: *mut CUevent, flags: c_uint) {
        check_init()?;
        if ph.is_null() || flags & !EVENT_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = lock();
        let (ctx, _) = inner.current()?;
        let handle = new_handle();
        inner.events.insert(
            handle,
            Event {
                ctx,
                flags,
                time: None,
                captured: None,
                pending: None,
            },
        );
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(ph, handle as CUevent) }
    }
}

fn record(event: CUevent, stream: CUstream, external: bool) -> Result<(), CUresult> {
    check_init()?;
    if driver::wall_timing() {
        return wall_record(event, stream, external);
    }
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    if !inner.events.contains_key(&(event as u64)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if let Some(id) = inner.capture_of(sref) {
        return capture_record(&mut inner, id, event, external);
    }
    let last = inner.timeline(sref).map_or(0, |t| t.last_end);
    let ev = inner
        .events
        .get_mut(&(event as u64))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    ev.time = Some(last.max(clock::now_ns()));
    ev.captured = None;
    Ok(())
}

/// Wall timing: queues the record for the stream's device thread, which
/// stamps the event when it gets there (or records into the capture, as in
/// timeline timing).
fn wall_record(event: CUevent, stream: CUstream, external: bool) -> Result<(), CUresult> {
    let device = lock().stream(stream)?.2;
    let device_thread = executor(device).ok_or(CUDA_ERROR_INVALID_DEVICE)?;
    device_thread.wait_for_room();
    let mut inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    if !inner.events.contains_key(&(event as u64)) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    if let Some(id) = inner.capture_of(sref) {
        return capture_record(&mut inner, id, event, external);
    }
    // A GPU reaches an event once the work before it on its stream is done
    // (other streams' work does not hold it up) and this context has the
    // device: with both, the event completes as soon as it is recorded.
    let last = inner.timeline(sref).map_or(0, |timeline| timeline.last_seq);
    let idle = device_thread.is_done(last)
        && driver::shared().is_ok_and(|shared| shared.device_idle(device));
    let (seq, time, pending) = if idle {
        (last, Some(clock::now_ns()), None)
    } else {
        let seq = device_thread.submit(Op::Record {
            event: event as u64,
        })?;
        (seq, None, Some((device, seq)))
    };
    if let Some(ev) = inner.events.get_mut(&(event as u64)) {
        ev.time = time;
        ev.captured = None;
        ev.pending = pending;
    }
    if let Some(timeline) = inner.timeline(sref) {
        timeline.last_seq = seq;
    }
    Ok(())
}

/// A record on a stream taking part in capture `id`: a node (external) or
/// a fork/join mark.
fn capture_record(
    inner: &mut Inner,
    id: u64,
    event: CUevent,
    external: bool,
) -> Result<(), CUresult> {
    if external {
        return inner.capture_append(id, NodeOp::EventRecord(event as u64));
    }
    if inner.captures.get(&id).is_some_and(|c| c.invalidated) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
    if let Some(ev) = inner.events.get_mut(&(event as u64)) {
        ev.captured = Some(id);
    }
    Ok(())
}

twin!(cuEventRecord, cuEventRecord_ptsz, (event: CUevent, stream: CUstream) {
    record(event, stream, false)
});

twin!(cuEventRecordWithFlags, cuEventRecordWithFlags_ptsz, (event: CUevent, stream: CUstream, flags: c_uint) {
    if flags & !CU_EVENT_RECORD_EXTERNAL != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    record(event, stream, flags & CU_EVENT_RECORD_EXTERNAL != 0)
});

/// (completion time, device, wall timing's pending operation) of an event;
/// `CUDA_ERROR_CAPTURED_EVENT` for one last recorded in a capture.
type EventState = (Option<u64>, Option<usize>, Option<(usize, u64)>);

fn event_time(event: CUevent) -> Result<EventState, CUresult> {
    check_init()?;
    let inner = lock();
    let ev = inner
        .events
        .get(&(event as u64))
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    if ev.captured.is_some() {
        return Err(CUDA_ERROR_CAPTURED_EVENT);
    }
    let device = inner.contexts.get(&ev.ctx).map(|c| c.device);
    Ok((ev.time, device, ev.pending))
}

cuda_fn! {
    fn cuEventSynchronize(event: CUevent) {
        let (time, device, pending) = event_time(event)?;
        if let Some((event_device, seq)) = pending {
            if let Some(device_thread) = executor(event_device) {
                device_thread.wait_for(seq);
            }
        } else if let Some(t) = time {
            driver::wait_until(t);
        }
        if let Some(d) = device {
            lock().trim_pools_to_threshold(Some(d));
        }
        Ok(())
    }
}

cuda_fn! {
    fn cuEventQuery(event: CUevent) {
        match event_time(event)? {
            (_, _, Some(_)) => Err(CUDA_ERROR_NOT_READY),
            (Some(t), _, None) if t > clock::now_ns() => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }
}

cuda_fn! {
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) {
        check_init()?;
        if ms.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = lock();
        let get = |e: CUevent| -> Result<u64, CUresult> {
            let ev = inner.events.get(&(e as u64)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if ev.flags & EVENT_DISABLE_TIMING != 0 {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            if ev.captured.is_some() {
                return Err(CUDA_ERROR_CAPTURED_EVENT);
            }
            if ev.pending.is_some() {
                return Err(CUDA_ERROR_NOT_READY);
            }
            ev.time.ok_or(CUDA_ERROR_INVALID_HANDLE)
        };
        let (a, b) = (get(start)?, get(end)?);
        let now = clock::now_ns();
        if a > now || b > now {
            return Err(CUDA_ERROR_NOT_READY);
        }
        let elapsed = (b as f64 - a as f64) / 1e6;
        // SAFETY: C API out-pointer, checked non-NULL.
        unsafe { out(ms, elapsed as f32) }
    }
}

cuda_fn! {
    fn cuEventDestroy_v2(event: CUevent) {
        check_init()?;
        lock()
            .events
            .remove(&(event as u64))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    }
}

/// A stream's capture status and capture id.
pub(crate) fn capture_status(stream: CUstream) -> Result<(CUstreamCaptureStatus, u64), CUresult> {
    let inner = lock();
    let (sref, _, _) = inner.stream(stream)?;
    Ok(match inner.capture_of(sref) {
        Some(id) => match inner.captures.get(&id) {
            Some(c) if c.invalidated => (CU_STREAM_CAPTURE_STATUS_INVALIDATED, id),
            Some(_) => (CU_STREAM_CAPTURE_STATUS_ACTIVE, id),
            None => (CU_STREAM_CAPTURE_STATUS_NONE, 0),
        },
        None => (CU_STREAM_CAPTURE_STATUS_NONE, 0),
    })
}
