//! How the daemon's other threads reach the event loop that owns the node core: they post to
//! its inbox (a channel, and the loop's mio `Waker` so that it looks), and read the reports it
//! publishes ([`Published`]). Nothing else is shared between threads.

use crate::node::Input;
use arc_swap::ArcSwap;
use gpushare_protocol::admin::{AdminReply, AdminRequest};
use gpushare_protocol::status::Report;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, SyncSender, channel};

/// What a thread hands to the event loop.
pub enum Post {
    /// An input for the node.
    Input(Input),
    /// An admin request; its reply is sent back on `reply`.
    Admin {
        req: AdminRequest,
        reply: SyncSender<AdminReply>,
    },
    /// The tenant socket, bound anew at its path (the last one's path had gone).
    Listener(std::os::unix::net::UnixListener),
}

/// A post, and when it was posted (`CLOCK_MONOTONIC` ns): how long it waited is the loop's
/// lateness.
pub type Letter = (u64, Post);

/// The event loop's inbox, for other threads.
#[derive(Clone)]
pub struct Inbox {
    tx: Sender<Letter>,
    waker: Arc<mio::Waker>,
}

impl Inbox {
    /// An inbox that wakes the loop through `waker`, and the loop's end of it.
    pub fn new(waker: mio::Waker) -> (Inbox, Receiver<Letter>) {
        let (tx, rx) = channel();
        let waker = Arc::new(waker);
        (Inbox { tx, waker }, rx)
    }

    /// Hand `post` to the event loop; `false` if the loop is gone.
    pub fn post(&self, post: Post) -> bool {
        self.post_all([post])
    }

    /// Hand `posts` to the event loop, in order, waking it once; `false` if the loop is gone.
    pub fn post_all(&self, posts: impl IntoIterator<Item = Post>) -> bool {
        let at = gpushare_units::monotonic_ns();
        for post in posts {
            if self.tx.send((at, post)).is_err() {
                return false;
            }
        }
        if let Err(e) = self.waker.wake() {
            tracing::error!("cannot wake the event loop: {e}");
        }
        true
    }

    /// Hand `input` to the node.
    pub fn input(&self, input: Input) -> bool {
        self.post(Post::Input(input))
    }

    /// Hand `inputs` to the node, in order, waking the loop once.
    pub fn inputs(&self, inputs: Vec<Input>) -> bool {
        self.post_all(inputs.into_iter().map(Post::Input))
    }
}

/// The latest report the event loop published, for the metrics endpoint and the admin
/// socket's `Usage`: read without waiting for the loop.
pub type Published = Arc<ArcSwap<Report>>;
