//! Who is asking: client-API keys are scoped to a principal so that no one
//! can fetch another user's response.

use crate::Fingerprint;
use http::request::Parts;
use http::HeaderName;
use std::fmt;
use std::marker::PhantomData;

/// Who is asking: client-API keys are scoped to the principal so that no one
/// can fetch another user's response.
///
/// Implemented by [`NoPrincipal`], [`HeaderPrincipal`], [`AuthorizationHash`],
/// [`ExtensionPrincipal`] and closures `Fn(&Parts) -> Option<String>`.
///
/// The principal must stay the same across a client's retries: prefer the
/// identity your authentication resolved ([`ExtensionPrincipal`]) to the
/// credential it was resolved from ([`AuthorizationHash`]).
pub trait Principal: Send + Sync + 'static {
    /// The principal of one request, if any.
    fn principal(&self, parts: &Parts) -> Option<String>;
}

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
#[derive(Debug, Clone)]
pub struct HeaderPrincipal(pub HeaderName);

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
