//! The simulated CUDA driver: a `libcuda.so` (SONAME `libcuda.so.1`) that real driver-API
//! programs load unmodified. Every call follows the driver's documented semantics; stream work
//! is timed by the shared device process (`gpushare-sim`), memory is real host memory so copies
//! round-trip.
//!
//! Layout: [`ffi`] holds the C types and the `entry!` export macros; [`client`] the connection
//! to the device; [`state`] the process's driver objects; the `api_*` modules the exported
//! entry points by area; [`checkpoint`] this process as the target of another's checkpoint
//! calls; [`image`] reads module images ([`ptx`] text, [`elf`] cubins,
//! [`fatbin`] containers).

// The documentation is read with the private items (`--document-private-items`), where
// links to them resolve.
#![allow(rustdoc::private_intra_doc_links)]

#[macro_use]
mod ffi;
mod api_checkpoint;
mod api_context;
mod api_device;
mod api_event;
mod api_export_table;
mod api_graph;
mod api_green;
mod api_ipc;
mod api_launch;
mod api_library;
mod api_link;
mod api_memop;
mod api_memory;
mod api_module;
mod api_multicast;
mod api_proc_address;
mod api_stream;
mod api_tensor_map;
mod checkpoint;
mod client;
mod elf;
mod fatbin;
mod image;
mod occupancy;
mod ptx;
mod state;
