//! The console at `/console/` on the admin listener: a page, its script and
//! its style, all in the binary (no CDN, no external font or script),
//! served with a `Content-Security-Policy` that allows only themselves. The
//! page is a thin client of the admin API: it asks for the token and sends
//! it in the `Authorization` header, never in a URL.

use axum::body::Body;
use http::{header, HeaderValue, Method, Response, StatusCode};

const INDEX: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// Only the console's own files, from its own origin; no frames, no forms
/// sent elsewhere, no inline script or style.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

/// Whether `path` is the console's.
pub(crate) fn is_console(path: &str) -> bool {
    path == "/console" || path.starts_with("/console/")
}

/// The console's answer for `method path`.
pub(crate) fn answer(method: &Method, path: &str) -> Response<Body> {
    let found = match path {
        "/console" => {
            let mut res = Response::new(Body::empty());
            *res.status_mut() = StatusCode::PERMANENT_REDIRECT;
            res.headers_mut()
                .insert(header::LOCATION, HeaderValue::from_static("/console/"));
            return res;
        }
        "/console/" | "/console/index.html" => Some((INDEX, "text/html; charset=utf-8")),
        "/console/console.js" => Some((SCRIPT, "text/javascript; charset=utf-8")),
        "/console/console.css" => Some((STYLE, "text/css; charset=utf-8")),
        _ => None,
    };
    let (status, body, kind) = match (found, method) {
        (Some((body, kind)), &Method::GET) => (StatusCode::OK, body, kind),
        (Some((_, kind)), &Method::HEAD) => (StatusCode::OK, "", kind),
        (Some(_), _) => (
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET\n",
            "text/plain; charset=utf-8",
        ),
        (None, _) => (
            StatusCode::NOT_FOUND,
            "no such page\n",
            "text/plain; charset=utf-8",
        ),
    };
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = status;
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}
