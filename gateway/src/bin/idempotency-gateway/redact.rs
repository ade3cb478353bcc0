//! Secrets kept out of logs and error messages: a URL's password and its
//! password-like query parameters replaced by `***`, in a URL, in any text
//! that names URLs, and in a backend's error that may quote them.

/// `url` with its password replaced by `***` (`redis://:pw@host` ->
/// `redis://:***@host`, `redis://user:pw@host` -> `redis://user:***@host`),
/// and the value of every password-like query parameter too
/// (`postgres://app@db/shop?password=pw` -> `postgres://***@db/shop?password=***`,
/// see [`is_secret`]), for logs and start errors.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return redact_query(url);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => format!("{}@{host}", redact_userinfo(userinfo)),
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{}", redact_query(tail))
}

/// A URL's userinfo with its password redacted: `user:***`, or `***` alone
/// (`redis://password@host` reads the userinfo as the password).
fn redact_userinfo(userinfo: &str) -> String {
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        None if userinfo.is_empty() => String::new(),
        None => "***".to_owned(),
    }
}

/// Whether a query parameter named `name` holds a secret: its name
/// (percent-decoded, any case) holds `pass`, `pwd`, `secret`, `token`,
/// `auth`, `key` or `credential` (`password`, `sslpassword`, `api_key`,
/// `AccessToken`, `authSecret`…).
fn is_secret(name: &str) -> bool {
    let name = percent_encoding::percent_decode_str(name)
        .decode_utf8_lossy()
        .to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "secret",
        "token",
        "auth",
        "key",
        "credential",
    ]
    .iter()
    .any(|word| name.contains(word))
}

/// `tail` (a URL's path, query and fragment) with the value of every
/// password-like query parameter replaced by `***`.
fn redact_query(tail: &str) -> String {
    let Some((path, rest)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let (query, fragment) = match rest.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (rest, None),
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    let mut out = format!("{path}?{}", pairs.join("&"));
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    out
}

/// `text` with the password of every URL in it redacted as [`redact`] does
/// (cluster lists `redis+cluster://:pw@a:1,:pw@b:2` included, and
/// password-like query parameters): start errors pass through it, whatever
/// wrote them (clap echoes a flag's value).
pub(crate) fn redact_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        out.push_str(&rest[..at + 3]);
        rest = &rest[at + 3..];
        // The URL ends at white space or a quote.
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '`' | '<' | '>'))
            .unwrap_or(rest.len());
        let (url, after) = rest.split_at(end);
        let authority_end = url.find(['/', '?', '#']).unwrap_or(url.len());
        let (authority, tail) = url.split_at(authority_end);
        let hosts: Vec<String> = authority
            .split(',')
            .map(|h| match h.rsplit_once('@') {
                Some((userinfo, host)) => format!("{}@{host}", redact_userinfo(userinfo)),
                None => h.to_owned(),
            })
            .collect();
        out.push_str(&hosts.join(","));
        out.push_str(&redact_query(tail));
        rest = after;
    }
    out.push_str(rest);
    out
}

/// `error`'s text with `url`'s password (and `url` itself) redacted, in case
/// the client library echoes them: the userinfo's password and the values of
/// password-like query parameters.
pub(crate) fn scrub(url: &str, error: impl std::fmt::Display) -> String {
    let mut text = error.to_string().replace(url, &redact(url));
    for secret in secrets(url) {
        text = text.replace(secret, "***");
    }
    text
}

/// The secrets `url` holds: its userinfo's password, and the values of its
/// password-like query parameters.
fn secrets(url: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    if let Some((userinfo, _)) = authority.rsplit_once('@') {
        found.push(userinfo.split_once(':').map_or(userinfo, |(_, p)| p));
    }
    if let Some((_, query)) = rest.split_once('?') {
        let query = query.split('#').next().unwrap_or_default();
        for pair in query.split('&') {
            if let Some((name, value)) = pair.split_once('=')
                && is_secret(name)
            {
                found.push(value);
            }
        }
    }
    found.retain(|s| !s.is_empty());
    found
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
        assert_eq!(
            scrub("postgres://db/x?password=hunter2", "auth failed (hunter2)"),
            "auth failed (***)"
        );
    }

    #[test]
    fn password_like_query_parameters_are_redacted() {
        for (url, shown) in [
            (
                "postgres://app@db/shop?password=hunter2",
                "postgres://***@db/shop?password=***",
            ),
            (
                "postgres://db/shop?sslmode=require&PassWord=hunter2&application_name=gw",
                "postgres://db/shop?sslmode=require&PassWord=***&application_name=gw",
            ),
            (
                "mysql://u:p@db/shop?pwd=hunter2&auth_token=t0k&apiKey=k3y#f",
                "mysql://u:***@db/shop?pwd=***&auth_token=***&apiKey=***#f",
            ),
            (
                "rediss://h:1/0?pass%77ord=hunter2",
                "rediss://h:1/0?pass%77ord=***",
            ),
            ("redis://h:1/0?secret", "redis://h:1/0?secret"),
            (
                "sqlite:///var/db.sqlite?mode=rwc",
                "sqlite:///var/db.sqlite?mode=rwc",
            ),
            ("sqlite:gw.db?token=x", "sqlite:gw.db?token=***"),
        ] {
            assert_eq!(redact(url), shown, "{url}");
        }
        assert_eq!(
            redact_text(
                "bad 'postgres://app@db/shop?password=hunter2' and \
                 mysql://db/x?sslmode=on&pass=hunter2 redis://:x@h:1/?db=1"
            ),
            "bad 'postgres://***@db/shop?password=***' and \
             mysql://db/x?sslmode=on&pass=*** redis://:***@h:1/?db=1"
        );
    }
}
