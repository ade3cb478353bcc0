//! Who is asking: client-API keys are scoped to a principal so that no one
//! can fetch another user's response.

use super::scope::escape_into;
use crate::Fingerprint;
use http::request::Parts;
use http::HeaderName;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// Who is asking: client-API keys are scoped to the principal so that no one
/// can fetch another user's response.
///
/// Implemented by [`NoPrincipal`], [`HeaderPrincipal`], [`AuthorizationHash`],
/// [`CookiePrincipal`], [`ExtensionPrincipal`], their combinations
/// ([`and`](Self::and), [`or`](Self::or)) and closures
/// `Fn(&Parts) -> Option<String>`.
///
/// A principal given to a layer **replaces** the preset's default (the hash
/// of `Authorization` for client keys): with `HeaderPrincipal` over a tenant
/// header, two users of one tenant share one scope. Combine principals to
/// scope to both, e.g. the tenant and the user's credential:
///
/// ```
/// use tower_idempotency::key::{AuthorizationHash, HeaderPrincipal, Principal};
///
/// let tenant_and_user = HeaderPrincipal::new("X-Tenant-Id").unwrap().and(AuthorizationHash);
/// let parts = |auth: &str| {
///     http::Request::post("/orders")
///         .header("x-tenant-id", "acme")
///         .header("authorization", auth)
///         .body(())
///         .unwrap()
///         .into_parts()
///         .0
/// };
/// let alice = tenant_and_user.principal(&parts("Bearer alice")).unwrap();
/// let bob = tenant_and_user.principal(&parts("Bearer bob")).unwrap();
/// assert!(alice.starts_with("acme:"));
/// assert_ne!(alice, bob);
/// ```
///
/// A request for which the principal finds nothing (no such header, cookie or
/// extension) is scoped to the route alone: every such request shares one
/// scope, so anyone who sends the same key and the same request gets its
/// replay. Put authentication in front of the layer when that matters.
///
/// The principal must stay the same across a client's retries: prefer the
/// identity your authentication resolved ([`ExtensionPrincipal`]) to the
/// credential it was resolved from ([`AuthorizationHash`]).
pub trait Principal: Send + Sync + 'static {
    /// The principal of one request, if any.
    fn principal(&self, parts: &Parts) -> Option<String>;

    /// Both principals: `self`'s and `other`'s, joined with `:` (each with
    /// `:`, `%` and `#` escaped, so the parts never run together; a part that
    /// finds nothing is empty). `None` only when neither finds anything.
    fn and<P: Principal>(self, other: P) -> AndPrincipal<Self, P>
    where
        Self: Sized,
    {
        AndPrincipal(self, other)
    }

    /// `self`'s principal, or `other`'s when `self` finds none (a session
    /// cookie, else the `Authorization` hash).
    fn or<P: Principal>(self, other: P) -> OrPrincipal<Self, P>
    where
        Self: Sized,
    {
        OrPrincipal(self, other)
    }
}

impl<P: Principal + ?Sized> Principal for Arc<P> {
    fn principal(&self, parts: &Parts) -> Option<String> {
        (**self).principal(parts)
    }
}

/// Two principals scoping together; from [`Principal::and`].
#[derive(Debug, Clone, Copy, Default)]
pub struct AndPrincipal<A, B>(A, B);

impl<A: Principal, B: Principal> Principal for AndPrincipal<A, B> {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let (a, b) = (self.0.principal(parts), self.1.principal(parts));
        if a.is_none() && b.is_none() {
            return None;
        }
        let mut out = String::new();
        escape_into(&mut out, a.as_deref().unwrap_or(""));
        out.push(':');
        escape_into(&mut out, b.as_deref().unwrap_or(""));
        Some(out)
    }
}

/// A principal with a fallback; from [`Principal::or`].
#[derive(Debug, Clone, Copy, Default)]
pub struct OrPrincipal<A, B>(A, B);

impl<A: Principal, B: Principal> Principal for OrPrincipal<A, B> {
    fn principal(&self, parts: &Parts) -> Option<String> {
        self.0.principal(parts).or_else(|| self.1.principal(parts))
    }
}

/// A header or cookie name that cannot be one; from [`HeaderPrincipal::new`]
/// and [`CookiePrincipal::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPrincipalName {
    what: &'static str,
    name: String,
}

impl fmt::Display for InvalidPrincipalName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` is not a valid {} name", self.name, self.what)
    }
}

impl std::error::Error for InvalidPrincipalName {}

impl<F> Principal for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// No principal: every sender shares one scope (the channel presets' default,
/// since a channel is one sender).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPrincipal;

impl Principal for NoPrincipal {
    fn principal(&self, _parts: &Parts) -> Option<String> {
        None
    }
}

/// The value of a header, such as a tenant id set by an authenticating proxy.
///
/// It replaces the `Authorization` hash of client keys (see [`Principal`]):
/// combine it with [`AuthorizationHash`] (`.and(AuthorizationHash)`) to scope
/// to the tenant and the user. The header must be set by something the
/// client cannot bypass; a request without it shares the route's scope.
///
/// ```
/// use tower_idempotency::key::{HeaderPrincipal, Principal};
///
/// let tenant = HeaderPrincipal::new("X-Tenant-Id").unwrap(); // any case
/// assert_eq!(tenant.name(), "x-tenant-id");
/// assert!(HeaderPrincipal::new("bad header").is_err());
/// let (parts, _) = http::Request::post("/").header("x-tenant-id", "acme").body(()).unwrap().into_parts();
/// assert_eq!(tenant.principal(&parts).as_deref(), Some("acme"));
/// ```
#[derive(Debug, Clone)]
pub struct HeaderPrincipal(pub HeaderName);

impl HeaderPrincipal {
    /// The principal is the value of the header `name` (any ASCII case);
    /// `Err` when `name` is not a header name.
    pub fn new(name: &str) -> Result<Self, InvalidPrincipalName> {
        HeaderName::from_bytes(name.as_bytes())
            .map(Self)
            .map_err(|_| InvalidPrincipalName {
                what: "header",
                name: name.to_owned(),
            })
    }

    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.0
    }
}

impl From<HeaderName> for HeaderPrincipal {
    fn from(name: HeaderName) -> Self {
        Self(name)
    }
}

impl Principal for HeaderPrincipal {
    fn principal(&self, parts: &Parts) -> Option<String> {
        parts
            .headers
            .get(&self.0)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }
}

/// A hash of the `Authorization` header (the idempotency-key preset's
/// default): the credential itself is never stored.
///
/// **Pitfall**: the hash is of the credential, not of the user. When a client
/// refreshes its bearer token (or a session cookie or API key rotates)
/// between two tries of one request, the retry lands in another scope and
/// runs again. Behind authentication middleware, scope keys to the identity
/// it resolved instead, with [`ExtensionPrincipal`].
#[derive(Debug, Clone, Copy, Default)]
pub struct AuthorizationHash;

impl Principal for AuthorizationHash {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let auth = parts.headers.get(http::header::AUTHORIZATION)?;
        let fp = Fingerprint::of(auth.as_bytes()).to_bytes();
        Some(fp.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// A hash of a cookie's value, such as a session id, for clients that
/// authenticate with a cookie instead of `Authorization`. Like
/// [`AuthorizationHash`], the credential itself is never stored.
///
/// It replaces the `Authorization` hash (see [`Principal`]); for routes that
/// serve both kinds of client, fall back to it:
/// `CookiePrincipal::new("sid")?.or(AuthorizationHash)`. A request without
/// the cookie has no principal (it shares the route's scope). The same
/// pitfall as the `Authorization` hash: a session that is renewed between two
/// tries of a request lands in another scope.
///
/// ```
/// use tower_idempotency::key::{CookiePrincipal, Principal};
///
/// let session = CookiePrincipal::new("sid").unwrap();
/// assert!(CookiePrincipal::new("s;d").is_err());
/// let parts = |cookie: &str| {
///     http::Request::post("/").header("cookie", cookie).body(()).unwrap().into_parts().0
/// };
/// let alice = session.principal(&parts("theme=dark; sid=alice")).unwrap();
/// assert_eq!(session.principal(&parts("sid=alice")), Some(alice.clone()));
/// assert_ne!(session.principal(&parts("sid=bob")), Some(alice));
/// assert_eq!(session.principal(&parts("theme=dark")), None);
/// ```
#[derive(Debug, Clone)]
pub struct CookiePrincipal {
    name: Arc<str>,
}

impl CookiePrincipal {
    /// The principal is a hash of the cookie `name`'s value (names are
    /// case-sensitive); `Err` when `name` is not a cookie name (an HTTP
    /// token: no spaces, `;`, `=`, quotes…).
    pub fn new(name: &str) -> Result<Self, InvalidPrincipalName> {
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if name.is_empty() || !name.bytes().all(token) {
            return Err(InvalidPrincipalName {
                what: "cookie",
                name: name.to_owned(),
            });
        }
        Ok(Self { name: name.into() })
    }

    /// The cookie's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cookie's value in the request (the first one, when it is sent
    /// twice).
    fn value<'p>(&self, parts: &'p Parts) -> Option<&'p str> {
        parts
            .headers
            .get_all(http::header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .find_map(|pair| {
                let (name, value) = pair.trim().split_once('=')?;
                (name.trim() == &*self.name).then(|| value.trim())
            })
            .filter(|v| !v.is_empty() && *v != "\"\"")
    }
}

impl Principal for CookiePrincipal {
    fn principal(&self, parts: &Parts) -> Option<String> {
        let value = self.value(parts)?;
        // Tagged, so that a cookie's hash never equals an `Authorization` hash.
        let mut input = Vec::with_capacity(value.len() + self.name.len() + 8);
        input.extend_from_slice(b"cookie\0");
        input.extend_from_slice(self.name.as_bytes());
        input.push(0);
        input.extend_from_slice(value.as_bytes());
        let fp = Fingerprint::of(&input).to_bytes();
        Some(fp.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// The identity an authentication middleware put into the request
/// extensions (a user id, a tenant, verified claims), which stays the same
/// when the client refreshes its token.
///
/// `ExtensionPrincipal::<T>::new()` uses `T`'s `Display`;
/// [`ExtensionPrincipal::map`] reads any type with a function. A request
/// without the extension has no principal: it shares one scope with every
/// other such request, so put the authentication middleware in front of this
/// layer and let it refuse unauthenticated requests.
///
/// ```
/// use tower_idempotency::key::{ExtensionPrincipal, Principal};
///
/// #[derive(Clone)]
/// struct Claims { sub: String }
///
/// let mut req = http::Request::post("/orders").body(()).unwrap();
/// req.extensions_mut().insert(Claims { sub: "user-7".into() });
/// let (parts, _) = req.into_parts();
///
/// let principal = ExtensionPrincipal::map(|c: &Claims| c.sub.clone());
/// assert_eq!(principal.principal(&parts).as_deref(), Some("user-7"));
///
/// // With a `Display` type the function is not needed.
/// let (parts, _) = http::Request::post("/").extension(42u64).body(()).unwrap().into_parts();
/// assert_eq!(ExtensionPrincipal::<u64>::new().principal(&parts).as_deref(), Some("42"));
/// ```
pub struct ExtensionPrincipal<T, F = fn(&T) -> String> {
    read: F,
    _type: PhantomData<fn() -> T>,
}

impl<T: fmt::Display> ExtensionPrincipal<T> {
    /// The principal is the extension `T`, written with `Display`.
    pub fn new() -> Self {
        Self {
            read: T::to_string,
            _type: PhantomData,
        }
    }
}

impl<T: fmt::Display> Default for ExtensionPrincipal<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, F> ExtensionPrincipal<T, F>
where
    F: Fn(&T) -> String,
{
    /// The principal is `read` of the extension `T`.
    pub fn map(read: F) -> Self {
        Self {
            read,
            _type: PhantomData,
        }
    }
}

impl<T, F: Clone> Clone for ExtensionPrincipal<T, F> {
    fn clone(&self) -> Self {
        Self {
            read: self.read.clone(),
            _type: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ExtensionPrincipal<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionPrincipal")
            .field("type", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T, F> Principal for ExtensionPrincipal<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> String + Send + Sync + 'static,
{
    fn principal(&self, parts: &Parts) -> Option<String> {
        parts.extensions.get::<T>().map(&self.read)
    }
}
