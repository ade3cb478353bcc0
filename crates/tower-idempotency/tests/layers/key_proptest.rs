//! No input panics key extraction, and the key layer never buffers past its
//! body limit: arbitrary bytes and mutations of the channel fixtures, through
//! every preset's extractor and through the key layer itself.
//!
//! More cases: `PROPTEST_CASES=10000 cargo test --test key_proptest`.

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::key::{ExtractKey, KeyLayer};
use tower_idempotency::Preset;

/// Counts the bytes allocated by the current thread while `TRACK` is on, to
/// bound what extraction holds at once.
struct Tracking;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    if TRACK.with(Cell::get) {
        let live = LIVE.with(|l| {
            l.set(l.get() + delta);
            l.get()
        });
        PEAK.with(|p| p.set(p.get().max(live)));
    }
}

// SAFETY: forwards to the system allocator; only counts.
#[allow(unsafe_code)] // a counting allocator cannot be written without it
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: the caller upholds `alloc`'s contract, which is `System`'s.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        // SAFETY: as for `alloc`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        note(new as isize - layout.size() as isize);
        // SAFETY: as for `alloc`.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// The most bytes one extraction may hold at once, for a body of `len`:
/// a small multiple of the body, never a function of anything else.
fn allowed(len: usize) -> isize {
    (16 * len + 16 * 1024) as isize
}

fn presets() -> Vec<Preset> {
    Preset::builtin_names()
        .iter()
        .map(|n| Preset::from_name(n).unwrap())
        .collect()
}

fn fixtures() -> Vec<Vec<u8>> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e != "md"))
        .map(|p| std::fs::read(p).unwrap())
        .collect();
    out.sort();
    assert!(out.len() >= 10, "fixtures missing");
    out
}

/// Every key header the presets read, set to `value` (any bytes a header
/// value may hold, visible ASCII or not).
fn parts_with(value: &[u8]) -> Parts {
    let mut req = Request::post("/notify").body(()).unwrap();
    if let Ok(v) = HeaderValue::from_bytes(value) {
        for name in ["webhook-id", "idempotency-key", "idempotency-token"] {
            req.headers_mut()
                .insert(HeaderName::from_static(name), v.clone());
        }
    }
    req.into_parts().0
}

/// Runs every preset's extractor on one request: no panic, the same answer
/// twice, and no more memory than [`allowed`].
fn check_all(presets: &[Preset], parts: &Parts, body: &[u8]) -> Result<(), TestCaseError> {
    let body = Bytes::copy_from_slice(body);
    for preset in presets {
        let extractor = preset.extractor();
        LIVE.with(|l| l.set(0));
        PEAK.with(|p| p.set(0));
        TRACK.with(|t| t.set(true));
        let first = extractor.extract(parts, &body);
        TRACK.with(|t| t.set(false));
        let peak = PEAK.with(Cell::get);
        prop_assert!(
            peak <= allowed(body.len()),
            "{}: {} bytes held for a body of {}",
            preset.name(),
            peak,
            body.len()
        );
        prop_assert_eq!(&first, &extractor.extract(parts, &body));
        if let Ok(Some(found)) = first {
            prop_assert!(!found.key.is_empty());
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    Repeat(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (
            any::<usize>(),
            prop::collection::vec(
                prop_oneof![
                    Just(b'{'),
                    Just(b'['),
                    Just(b'"'),
                    Just(b'<'),
                    Just(b'&'),
                    Just(b'%'),
                    Just(b'='),
                    any::<u8>()
                ],
                0..16
            )
        )
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 0..64usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), 1..32usize, 1..64usize).prop_map(|(i, n, k)| Mutation::Repeat(i, n, k)),
    ]
}

fn apply(body: &mut Vec<u8>, m: &Mutation) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % (len + 1) };
    match m {
        Mutation::Flip(i, b) if !body.is_empty() => {
            let i = i % body.len();
            body[i] ^= b;
        }
        Mutation::Insert(i, v) => {
            let i = at(*i, body.len());
            body.splice(i..i, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let i = at(*i, body.len());
            let end = (i + n).min(body.len());
            body.drain(i..end);
        }
        Mutation::Truncate(i) => body.truncate(at(*i, body.len())),
        // Repeats a slice: deep nesting, long runs of one field.
        Mutation::Repeat(i, n, k) => {
            let i = at(*i, body.len());
            let end = (i + n).min(body.len());
            let piece = body[i..end].to_vec();
            for _ in 0..*k {
                body.splice(i..i, piece.iter().copied());
            }
        }
        Mutation::Flip(..) => {}
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(
        body in prop::collection::vec(any::<u8>(), 0..4096),
        header in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        check_all(&presets(), &parts_with(&header), &body)?;
    }

    #[test]
    fn mutated_fixtures_never_panic(
        which in any::<usize>(),
        mutations in prop::collection::vec(mutation(), 1..8),
        header in prop_oneof![Just(b"msg_1".to_vec()), prop::collection::vec(any::<u8>(), 0..40)],
    ) {
        let fixtures = fixtures();
        let mut body = fixtures[which % fixtures.len()].clone();
        for m in &mutations {
            apply(&mut body, m);
        }
        check_all(&presets(), &parts_with(&header), &body)?;
    }
}

/// A request body sent in chunks, counting the bytes it handed out.
struct Chunks {
    chunks: std::vec::IntoIter<Bytes>,
    pulled: Arc<AtomicUsize>,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.chunks.next().map(|c| {
            self.pulled.fetch_add(c.len(), Ordering::SeqCst);
            Ok(Frame::data(c))
        }))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn the_key_layer_never_buffers_past_its_limit(
        preset in 0..Preset::builtin_names().len(),
        limit in 1..8192usize,
        chunks in prop::collection::vec(1..2048usize, 0..24),
        fill in any::<u8>(),
    ) {
        let preset = Preset::from_name(Preset::builtin_names()[preset]).unwrap();
        let biggest = chunks.iter().copied().max().unwrap_or(0);
        let total: usize = chunks.iter().sum();
        let pulled = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicUsize::new(0));
        let body = Chunks {
            chunks: chunks
                .iter()
                .map(|&n| Bytes::from(vec![fill; n]))
                .collect::<Vec<_>>()
                .into_iter(),
            pulled: pulled.clone(),
        };
        let svc = ServiceBuilder::new()
            .layer(KeyLayer::new(preset.extractor().clone()).max_body_bytes(limit))
            .service(service_fn({
                let seen = seen.clone();
                move |req: Request<Full<Bytes>>| {
                    let seen = seen.clone();
                    async move {
                        let len = http_body_util::BodyExt::collect(req.into_body())
                            .await
                            .unwrap()
                            .to_bytes()
                            .len();
                        seen.store(len, Ordering::SeqCst);
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                    }
                }
            }));
        let req = Request::post("/notify")
            .header("idempotency-key", "k")
            .header("webhook-id", "k")
            .body(body)
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let res = rt.block_on(svc.oneshot(req)).unwrap();
        prop_assert!(
            pulled.load(Ordering::SeqCst) <= limit + biggest,
            "read {} bytes with a limit of {limit}",
            pulled.load(Ordering::SeqCst)
        );
        prop_assert!(seen.load(Ordering::SeqCst) <= limit);
        if total > limit {
            prop_assert_eq!(res.status(), 413);
        } else {
            prop_assert_ne!(res.status(), 413);
        }
    }
}

/// A JSON value without floats (whose written form a parse does not keep)
/// and with repeated-free objects, as `serde_json::Value` holds them.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-c/~\"\\\\é ]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 40, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-c/~0-9]{0,3}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Every pointer into `value`, plus some that miss.
fn pointers_of(value: &serde_json::Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match value {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let token = k.replace('~', "~0").replace('/', "~1");
                pointers_of(v, format!("{at}/{token}"), out);
            }
            out.push(format!("{at}/zz"));
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                pointers_of(v, format!("{at}/{i}"), out);
            }
            out.push(format!("{at}/{}", a.len()));
            out.push(format!("{at}/01"));
        }
        _ => out.push(format!("{at}/x")),
    }
}

/// What a key field holds, by serde_json's own pointer lookup: strings as
/// they are, scalars as written, objects and arrays in canonical form.
fn oracle(value: &serde_json::Value, pointer: &str) -> Option<String> {
    let text = match value.pointer(pointer)? {
        serde_json::Value::Null => return None,
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    (!text.is_empty()).then_some(text)
}

proptest! {
    /// The one-pass reader finds, for every pointer a spec names at once,
    /// what serde_json's tree lookup finds, in compact and in spaced JSON.
    #[test]
    fn json_fields_read_in_one_pass_match_a_tree_lookup(
        value in json_value(),
        pick in prop::collection::vec(any::<prop::sample::Index>(), 1..5),
        spaced in any::<bool>(),
    ) {
        use tower_idempotency::key::{Field, FingerprintSpec, KeySpec};
        let mut all = Vec::new();
        pointers_of(&value, String::new(), &mut all);
        let chosen: Vec<String> = pick.iter().map(|i| i.get(&all).clone()).collect();
        let body = match spaced {
            true => serde_json::to_string_pretty(&value).unwrap(),
            false => value.to_string(),
        };
        let body = Bytes::from(body);
        let (parts, ()) = Request::post("/").body(()).unwrap().into_parts();
        // Every chosen pointer in one spec (the key reads the first; the
        // others ride along in the fingerprint's single pass) ...
        let fields: Vec<Field> = chosen.iter().map(|p| Field::json(p.clone())).collect();
        for (i, pointer) in chosen.iter().enumerate() {
            let mut rest = fields.clone();
            let key_field = rest.remove(i);
            let spec = KeySpec::new([key_field], FingerprintSpec::Fields(rest));
            let got = spec.extract(&parts, &body).unwrap().map(|e| e.key);
            prop_assert_eq!(got, oracle(&value, pointer), "pointer {:?} in {}", pointer, body.len());
        }
    }
}
