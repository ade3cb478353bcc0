//! The store picked on the command line: the library's `Either` of the
//! memory store, Redis and Redis Cluster.

use crate::parse::StoreSpec;
use tower_idempotency::store::{
    Either, MemoryStore, OwnerToken, RedisClusterStore, RedisStore, Store,
};

/// The gateway's store; clones share it.
pub type GatewayStore = Either<MemoryStore, Either<RedisStore, RedisClusterStore>>;

/// Budgets of the stores' memory.
pub struct Budgets {
    /// The memory store's budget.
    pub max_memory: u64,
    /// The Redis store's local tier.
    pub local_max_memory: u64,
}

/// Connects to the store.
pub async fn connect(spec: &StoreSpec, budgets: &Budgets) -> Result<GatewayStore, String> {
    Ok(match spec {
        StoreSpec::Memory => {
            Either::Left(MemoryStore::builder().max_bytes(budgets.max_memory).build())
        }
        StoreSpec::Redis(url) => Either::Right(Either::Left(
            RedisStore::standalone(url.as_str())
                .await
                .map_err(|e| format!("cannot reach Redis at {}: {}", redact(url), scrub(url, e)))?
                .local_max_bytes(budgets.local_max_memory),
        )),
        StoreSpec::Cluster(nodes) => Either::Right(Either::Right(
            RedisStore::cluster(nodes.iter().map(String::as_str))
                .await
                .map_err(|e| {
                    let shown: Vec<String> = nodes.iter().map(|n| redact(n)).collect();
                    let e = nodes.iter().fold(e.to_string(), |e, n| scrub(n, e));
                    format!("cannot reach the Redis Cluster at {shown:?}: {e}")
                })?
                .local_max_bytes(budgets.local_max_memory),
        )),
    })
}

/// The store's kind, for the start-up log line.
pub fn describe(store: &GatewayStore) -> &'static str {
    match store {
        Either::Left(_) => "memory",
        Either::Right(Either::Left(_)) => "redis",
        Either::Right(Either::Right(_)) => "redis-cluster",
    }
}

/// Whether the store answers: one read of a key nobody writes.
pub async fn ready(store: &GatewayStore) -> bool {
    store
        .take_token("gateway:readyz-probe", OwnerToken::new())
        .await
        .is_ok()
}

/// `url` with its password replaced by `***` (`redis://:pw@host` ->
/// `redis://:***@host`, `redis://user:pw@host` -> `redis://user:***@host`),
/// for logs and start errors.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    let user = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        None if userinfo.is_empty() => String::new(),
        // `redis://password@host` reads the userinfo as the password.
        None => "***".to_owned(),
    };
    format!("{scheme}://{user}@{host}{tail}")
}

/// `text` with the password of every URL in it redacted as [`redact`] does
/// (cluster lists `redis+cluster://:pw@a:1,:pw@b:2` included): start errors
/// pass through it, whatever wrote them (clap echoes a flag's value).
pub fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        out.push_str(&rest[..at + 3]);
        rest = &rest[at + 3..];
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '/' | '\'' | '"' | '`' | '?' | '#'))
            .unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let hosts: Vec<String> = authority
            .split(',')
            .map(|h| match h.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _)) => format!("{user}:***@{host}"),
                    None if userinfo.is_empty() => format!("@{host}"),
                    None => format!("***@{host}"),
                },
                None => h.to_owned(),
            })
            .collect();
        out.push_str(&hosts.join(","));
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// `error`'s text with `url`'s password (and `url` itself) redacted, in case
/// the client library echoes them.
pub fn scrub(url: &str, error: impl std::fmt::Display) -> String {
    let mut text = error.to_string().replace(url, &redact(url));
    if let Some(password) = password(url) {
        text = text.replace(password, "***");
    }
    text
}

fn password(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = authority.rsplit_once('@')?.0;
    let password = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
    (!password.is_empty()).then_some(password)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        for (url, shown) in [
            (
                "redis://:s3cr3t-pw@10.0.0.5:6379",
                "redis://:***@10.0.0.5:6379",
            ),
            ("redis://user:s3cr3t-pw@h:1/0", "redis://user:***@h:1/0"),
            ("rediss://s3cr3t-pw@h:1", "rediss://***@h:1"),
            ("redis://h:1/0", "redis://h:1/0"),
            ("redis://u:p@ss@h:1", "redis://u:***@h:1"),
        ] {
            assert_eq!(redact(url), shown);
        }
        assert_eq!(
            redact_text("bad 'redis+cluster://:pw@a:1,u:pw@b:2/' and redis://:x@h:1 rediss://h:2"),
            "bad 'redis+cluster://:***@a:1,u:***@b:2/' and redis://:***@h:1 rediss://h:2"
        );
        assert_eq!(
            scrub("redis://:pw1@h:1", "failed for redis://:pw1@h:1 (pw1)"),
            "failed for redis://:***@h:1 (***)"
        );
    }
}
