//! How the state takes the events of one kind's watch: the reflector
//! pattern of kube-runtime, where a list begins, brings each object and
//! ends, then changes follow. Each kind's events are applied in its own
//! module of [`crate::cache::state`].

use kube::runtime::watcher::Event;

/// Whether a watched kind's first complete list is in, for placements that
/// wait for it; a kind nobody watches, or whose watch the API server
/// refuses to this extender, keeps none waiting.
#[derive(Clone, Copy, Debug, Default)]
pub struct Listing {
    watched: bool,
    listed: bool,
    refused: bool,
}

impl Listing {
    /// The kind is watched from now on.
    pub fn expect(&mut self) {
        self.watched = true;
    }

    /// Whether placements may go ahead.
    pub fn ready(&self) -> bool {
        !self.watched || self.listed || self.refused
    }

    /// The API server refused the watch.
    pub fn refuse(&mut self) {
        self.refused = true;
    }

    /// A complete list is in; true the first time.
    pub fn listed(&mut self) -> bool {
        let first = !self.listed;
        self.listed = true;
        self.refused = false;
        first
    }
}

/// What a refused watch means for a book, logged once while it lasts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchRefusal {
    /// Expected on some clusters: logged as information.
    Info(&'static str),
    /// A misconfiguration the operator should see: logged as a warning.
    Warn(&'static str),
}

/// A book kept from the watch of kind `K`.
pub trait Book<K> {
    /// The kind's name in logs.
    const KIND: &'static str;

    /// Takes one event of the watch.
    fn apply_event(&mut self, event: Event<K>);

    /// The API server refused the watch with HTTP status `code`: what that
    /// means, when it means more than a failure to retry (the book has
    /// then taken it into account).
    fn refused(&mut self, _code: u16) -> Option<WatchRefusal> {
        None
    }

    /// Takes a complete list, as the watch does on start and after a
    /// failure: what the list does not hold is gone.
    fn relist(&mut self, objects: impl IntoIterator<Item = K>)
    where
        Self: Sized,
    {
        self.apply_event(Event::Init);
        for object in objects {
            self.apply_event(Event::InitApply(object));
        }
        self.apply_event(Event::InitDone);
    }

    /// Takes one object added or changed.
    fn apply(&mut self, object: K) {
        self.apply_event(Event::Apply(object));
    }

    /// Takes one object deleted.
    fn delete(&mut self, object: K) {
        self.apply_event(Event::Delete(object));
    }
}
