//! Reading JSON from the network within bounds.
//!
//! A request's size is limited where it is read (`crate::server`), but
//! size alone does not bound memory: parsed into k8s-openapi's types, the
//! 11 bytes `{"name":""}` in a pod's `volumes` become a 3,280-byte
//! `Volume`, and the 3 bytes `"",` in a list a 24-byte `String`, so an
//! 8 MiB body could take gigabytes. Here:
//!
//! - [`check_shape`] counts a document's objects and values without
//!   keeping anything, and refuses one with more than its limits before it
//!   is parsed into those types ([`read_pod`]);
//! - [`optional_vec`] and [`optional_map`] read a list or map of at most
//!   a given length, for the parts of a request that are lists of nodes or
//!   pods, and stop at the first element past it.
//!
//! Leaf module: serde and k8s-openapi only.

use k8s_openapi::api::core::v1::Pod;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use thiserror::Error;

/// The most objects and values a document may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShapeLimits {
    /// Objects (`{...}`): each may become a struct of kilobytes.
    pub objects: usize,
    /// Values of every kind, map entries included: each becomes at least a
    /// pointer-sized slot of a list or map.
    pub values: usize,
}

/// What a pod, as kube-scheduler or the API server sends it, may hold.
///
/// Generous for real pods: one with 10 containers of 100 environment
/// variables and 50 mounts each, 100 volumes and its managed fields has
/// about 4,000 objects and 25,000 values. Parsed, the worst 10,000 objects
/// (all `Volume`s, the largest struct of a pod at 3,280 bytes, their list
/// doubled as it grows) take at most 66 MB, and 200,000 values at most
/// 200,000 × ~100 bytes (a map entry with its share of a B-tree node) =
/// 20 MB.
pub const POD_SHAPE: ShapeLimits = ShapeLimits {
    objects: 10_000,
    values: 200_000,
};

/// A document beyond its [`ShapeLimits`], or not JSON.
#[derive(Debug, Error)]
pub enum ShapeError {
    #[error("it has more than {0} JSON objects")]
    Objects(usize),
    #[error("it has more than {0} JSON values")]
    Values(usize),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// A pod that could not be read.
#[derive(Debug, Error)]
pub enum PodJsonError {
    /// Within the size limit but too many objects or values to parse.
    #[error("the pod is too large to read: {0}")]
    TooLarge(ShapeError),
    /// Not JSON of a pod.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl PodJsonError {
    /// Whether the pod was refused for its size rather than its syntax.
    pub fn too_large(&self) -> bool {
        matches!(self, Self::TooLarge(_))
    }
}

/// Checks that `json` is one JSON document within `limits`, keeping
/// nothing of it; stops at the first object or value past a limit.
pub fn check_shape(json: &str, limits: ShapeLimits) -> Result<(), ShapeError> {
    let mut counter = Counter {
        limits,
        objects: 0,
        values: 0,
        exceeded: None,
    };
    let mut deserializer = serde_json::Deserializer::from_str(json);
    let counted = CountValue(&mut counter)
        .deserialize(&mut deserializer)
        .and_then(|()| deserializer.end());
    match (counted, counter.exceeded) {
        (_, Some(exceeded)) => Err(exceeded),
        (Err(error), None) => Err(ShapeError::Json(error)),
        (Ok(()), None) => Ok(()),
    }
}

/// Parses a pod after checking its shape against [`POD_SHAPE`].
pub fn read_pod(json: &str) -> Result<Pod, PodJsonError> {
    match check_shape(json, POD_SHAPE) {
        Ok(()) => Ok(serde_json::from_str(json)?),
        Err(ShapeError::Json(error)) => Err(PodJsonError::Json(error)),
        Err(exceeded) => Err(PodJsonError::TooLarge(exceeded)),
    }
}

struct Counter {
    limits: ShapeLimits,
    objects: usize,
    values: usize,
    /// Set when a limit is passed: the parse then stops with an error
    /// whose words do not matter.
    exceeded: Option<ShapeError>,
}

impl Counter {
    fn value<E: de::Error>(&mut self) -> Result<(), E> {
        self.values += 1;
        if self.values > self.limits.values {
            self.exceeded = Some(ShapeError::Values(self.limits.values));
            return Err(E::custom("too many values"));
        }
        Ok(())
    }

    fn object<E: de::Error>(&mut self) -> Result<(), E> {
        self.objects += 1;
        if self.objects > self.limits.objects {
            self.exceeded = Some(ShapeError::Objects(self.limits.objects));
            return Err(E::custom("too many objects"));
        }
        self.value()
    }
}

/// Counts one value and everything in it.
struct CountValue<'c>(&'c mut Counter);

impl<'de> DeserializeSeed<'de> for CountValue<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for CountValue<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.0.value()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.0.value()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.0.value()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.0.value()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.0.value()
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.0.value()
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.value()?;
        while seq.next_element_seed(CountValue(self.0))?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.0.object()?;
        while map.next_key::<IgnoredAny>()?.is_some() {
            // The entry itself: a slot in a map or a struct's field.
            self.0.value()?;
            map.next_value_seed(CountValue(self.0))?;
        }
        Ok(())
    }
}

/// A string borrowed from the request body when it has no escapes (node
/// names never do), so thousands of node names cost no copies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Text<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TextVisitor;

        impl<'de> Visitor<'de> for TextVisitor {
            type Value = Text<'de>;

            fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
                formatter.write_str("a string")
            }

            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(text)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(text.to_string())))
            }
        }

        deserializer.deserialize_str(TextVisitor)
    }
}

impl serde::Serialize for Text<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

/// `null` or a list of at most `max` elements (`what` names them in the
/// error); for `#[serde(deserialize_with)]` through a function that fixes
/// `max` and `what`.
pub fn optional_vec<'de, D, T>(
    deserializer: D,
    max: usize,
    what: &'static str,
) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    deserializer.deserialize_option(Optional(BoundedSeq {
        max,
        what,
        element: PhantomData,
    }))
}

/// `null` or a map of at most `max` entries (`what` names them).
pub fn optional_map<'de, D, V>(
    deserializer: D,
    max: usize,
    what: &'static str,
) -> Result<Option<BTreeMap<String, V>>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    deserializer.deserialize_option(Optional(BoundedMap {
        max,
        what,
        value: PhantomData,
    }))
}

/// A list or a map read by a visitor of its own.
trait Collection<'de>: Visitor<'de> {
    fn read<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error>;
}

/// `null` as `None`, anything else read as the collection.
struct Optional<V>(V);

impl<'de, V: Collection<'de>> Visitor<'de> for Optional<V> {
    type Value = Option<V::Value>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        self.0.expecting(formatter)?;
        formatter.write_str(" or null")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        self.0.read(deserializer).map(Some)
    }
}

struct BoundedSeq<T> {
    max: usize,
    what: &'static str,
    element: PhantomData<fn() -> T>,
}

impl<'de, T: Deserialize<'de>> Collection<'de> for BoundedSeq<T> {
    fn read<D: Deserializer<'de>>(self, deserializer: D) -> Result<Vec<T>, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for BoundedSeq<T> {
    type Value = Vec<T>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(formatter, "a list of at most {} {}", self.max, self.what)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            if items.len() == self.max {
                return Err(de::Error::custom(format_args!(
                    "more than {} {}",
                    self.max, self.what
                )));
            }
            items.push(item);
        }
        Ok(items)
    }
}

struct BoundedMap<V> {
    max: usize,
    what: &'static str,
    value: PhantomData<fn() -> V>,
}

impl<'de, V: Deserialize<'de>> Collection<'de> for BoundedMap<V> {
    fn read<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, V: Deserialize<'de>> Visitor<'de> for BoundedMap<V> {
    type Value = BTreeMap<String, V>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        write!(formatter, "a map of at most {} {}", self.max, self.what)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = BTreeMap::new();
        while let Some((key, value)) = map.next_entry::<String, V>()? {
            if entries.len() == self.max {
                return Err(de::Error::custom(format_args!(
                    "more than {} {}",
                    self.max, self.what
                )));
            }
            entries.insert(key, value);
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_counted_and_refused_past_their_limits() {
        let limits = ShapeLimits {
            objects: 3,
            values: 10,
        };
        assert!(check_shape(r#"{"a":{"b":[1,"x\"}{",null]}}"#, limits).is_ok());
        // Braces inside strings are not objects.
        assert!(check_shape(r#"["{{{{{{{{", "}}}"]"#, limits).is_ok());
        let objects = check_shape(r#"[{},{},{},{}]"#, limits).expect_err("4 objects");
        assert!(matches!(objects, ShapeError::Objects(3)), "{objects:?}");
        let values = check_shape("[1,2,3,4,5,6,7,8,9,10]", limits).expect_err("11 values");
        assert!(matches!(values, ShapeError::Values(10)), "{values:?}");
        assert!(matches!(check_shape("{", limits), Err(ShapeError::Json(_))));
        assert!(matches!(
            check_shape("[1] [2]", limits),
            Err(ShapeError::Json(_))
        ));
    }

    #[test]
    fn a_pod_of_many_tiny_volumes_is_refused_before_it_is_parsed() {
        // 20,000 volumes of 12 bytes each: 240 kB of JSON that would be
        // 66 MB as k8s-openapi Volumes.
        let volumes = vec![r#"{"name":""}"#; 20_000].join(",");
        let pod = format!(r#"{{"spec":{{"containers":[],"volumes":[{volumes}]}}}}"#);
        let error = read_pod(&pod).expect_err("refused");
        assert!(error.too_large(), "{error}");
        assert_eq!(
            error.to_string(),
            "the pod is too large to read: it has more than 10000 JSON objects"
        );
        let error = read_pod(r#"{"spec":{"containers":7}}"#).expect_err("not a pod");
        assert!(!error.too_large(), "{error}");
        let pod = read_pod(r#"{"metadata":{"name":"p"},"spec":{"containers":[{"name":"c"}]}}"#)
            .expect("a pod");
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));
    }

    #[derive(Debug, Deserialize)]
    struct Lists<'a> {
        #[serde(default, borrow, deserialize_with = "three_names")]
        names: Option<Vec<Text<'a>>>,
        #[serde(default, deserialize_with = "two_entries")]
        map: Option<BTreeMap<String, u32>>,
    }

    fn three_names<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Text<'de>>>, D::Error> {
        optional_vec(d, 3, "names")
    }

    fn two_entries<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<BTreeMap<String, u32>>, D::Error> {
        optional_map(d, 2, "entries")
    }

    #[test]
    fn lists_and_maps_stop_past_their_length() {
        let body = r#"{"names":["a","b\"c","d"],"map":{"x":1,"y":2}}"#;
        let lists: Lists = serde_json::from_str(body).expect("within bounds");
        let names = lists.names.expect("names");
        assert!(matches!(names[0].0, Cow::Borrowed("a")), "borrowed");
        assert_eq!(names[1].0, "b\"c");
        assert_eq!(lists.map.expect("map").len(), 2);
        let lists: Lists = serde_json::from_str(r#"{"names":null}"#).expect("null");
        assert!(lists.names.is_none() && lists.map.is_none());
        let error = serde_json::from_str::<Lists>(r#"{"names":["a","b","c","d"]}"#)
            .expect_err("four names");
        assert!(error.to_string().contains("more than 3 names"), "{error}");
        let error = serde_json::from_str::<Lists>(r#"{"map":{"a":1,"b":2,"c":3}}"#)
            .expect_err("three entries");
        assert!(error.to_string().contains("more than 2 entries"), "{error}");
        assert!(serde_json::from_str::<Lists>(r#"{"names":"a"}"#).is_err());
    }
}
