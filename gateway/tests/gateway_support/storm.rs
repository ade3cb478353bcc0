//! The shared channel vectors sent through a running gateway in front of
//! the recording upstream.

use super::Gateway;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use test_support::common::upstream::Upstream;
use test_support::common::vectors::{check, Vector, ALL};
use test_support::common::{all_at_once, read, Answer, HttpClient};

/// Copies of one notification sent at the same instant.
pub const K: usize = 7;

/// Request headers, owned.
pub type Headers = Vec<(String, String)>;

/// Every vector of the table, preset by preset.
pub fn vectors() -> impl Iterator<Item = &'static Vector> {
    ALL.iter().flat_map(|vs| vs.iter())
}

/// The name of every preset.
pub fn presets() -> impl Iterator<Item = &'static str> {
    ALL.iter().map(|vs| vs[0].channel.name)
}

/// The headers of `v`, with `extra` added.
pub fn headers_with(v: &Vector, extra: &[(&str, &str)]) -> Headers {
    let mut headers = v.base().headers;
    headers.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    headers
}

/// POSTs `body` with `headers` to `url`.
pub async fn send(
    client: &HttpClient,
    url: &str,
    headers: &[(String, String)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut req = Request::post(url);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let res = client
        .request(req.body(Full::new(body.into())).unwrap())
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    read(res).await
}

/// `v` sent once to `url`.
pub async fn send_vector(client: &HttpClient, url: &str, v: &Vector) -> Answer {
    let base = v.base();
    send(client, url, &base.headers, base.body).await
}

/// Asserts `a` is the success reply to `v` at `path`: the channel's own, or
/// (client APIs) the upstream's answer to its first call.
pub fn assert_success(v: &Vector, a: &Answer, path: &str, what: &str) {
    match v.channel.success {
        Some(reply) => check(a, reply, what),
        None => {
            assert_eq!(a.status, 200, "{what}: status; body {:?}", a.text());
            let ct = a
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            assert!(ct.contains("text/plain"), "{what}: content-type {ct:?}");
            assert_eq!(
                a.text(),
                format!("upstream call 1 for {path}"),
                "{what}: body"
            );
        }
    }
}

/// K copies of `v` to `path` at once: every copy gets the success reply,
/// K-1 of them replayed, and the upstream sees one call with the request's
/// own bytes.
pub async fn storm(client: &HttpClient, gw: &Gateway, up: &Upstream, v: &Vector, path: &str) {
    let url = gw.url(path);
    let base = v.base();
    let answers = all_at_once(K, |_| {
        let (client, url, headers, body) = (
            client.clone(),
            url.clone(),
            base.headers.clone(),
            base.body.clone(),
        );
        async move { send(&client, &url, &headers, body).await }
    })
    .await;
    let what = format!("{} at {path}", v.label());
    for a in &answers {
        assert_success(v, a, path, &what);
    }
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(replayed, K - 1, "{what}: replayed copies");
    assert_eq!(up.calls(path), 1, "{what}: upstream calls");
    assert_eq!(
        up.last(path).body,
        base.body,
        "{what}: the upstream got other bytes"
    );
}
