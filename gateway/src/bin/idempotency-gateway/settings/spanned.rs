//! Values of the config file with where they were written: an error names
//! the file and the line.

use serde::Deserialize;
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use toml::Spanned;

pub(crate) type Field = Option<Spanned<String>>;

/// A size written as a number of bytes or a string (`"64KiB"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum SizeValue {
    Bytes(u64),
    Text(String),
}

/// A bad file: `FILE:LINE: reason`.
pub(crate) struct At<'a> {
    pub(crate) path: &'a str,
    pub(crate) text: &'a str,
}

impl At<'_> {
    pub(crate) fn err(&self, span: std::ops::Range<usize>, why: impl std::fmt::Display) -> String {
        let line = self.text[..span.start.min(self.text.len())]
            .matches('\n')
            .count()
            + 1;
        format!("{}:{line}: {why}", self.path)
    }

    /// A file named by a flag (`flag`) or by the config file's `key`
    /// (`field`), checked by `check` (which reads it): an error about a file
    /// the config file named says that line.
    pub(crate) fn file<T>(
        &self,
        flag: Option<&Path>,
        field: &Option<Spanned<PathBuf>>,
        key: &str,
        check: impl Fn(&Path) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        match (flag, field) {
            (Some(path), _) => check(path).map(Some),
            (None, Some(v)) => check(v.get_ref())
                .map(Some)
                .map_err(|e| self.err(v.span(), format!("`{key}`: {e}"))),
            (None, None) => Ok(None),
        }
    }

    /// A value from the file checked by `f`; an error names its line.
    pub(crate) fn checked<V, T>(
        &self,
        field: &Option<Spanned<V>>,
        key: &str,
        f: impl Fn(&V) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        field
            .as_ref()
            .map(|v| f(v.get_ref()).map_err(|e| self.err(v.span(), format!("`{key}`: {e}"))))
            .transpose()
    }

    /// A value from the file read by the flag's own parser `f` (a number
    /// or a size as the text a flag would give); an error names its line.
    pub(crate) fn value<V: FileValue, T>(
        &self,
        field: &Option<Spanned<V>>,
        key: &str,
        f: fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        self.checked(field, key, |v| f(&v.text()))
    }

    /// The flag's value, else the file's `key` (read by the flag's parser
    /// `f`), else `None` for the caller's default. A bad file value is an
    /// error naming its line even when the flag overrides it.
    pub(crate) fn pick<V: FileValue, T>(
        &self,
        flag: Option<T>,
        field: &Option<Spanned<V>>,
        key: &str,
        f: fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        let file = self.value(field, key, f)?;
        Ok(flag.or(file))
    }
}

/// A config-file value as the text a flag would give, for the flag's parser.
pub(crate) trait FileValue {
    fn text(&self) -> Cow<'_, str>;
}

impl FileValue for String {
    fn text(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl FileValue for u64 {
    fn text(&self) -> Cow<'_, str> {
        Cow::Owned(self.to_string())
    }
}

impl FileValue for f64 {
    fn text(&self) -> Cow<'_, str> {
        Cow::Owned(self.to_string())
    }
}

/// Bytes pass the same checks as text (`0` included).
impl FileValue for SizeValue {
    fn text(&self) -> Cow<'_, str> {
        match self {
            SizeValue::Bytes(n) => Cow::Owned(n.to_string()),
            SizeValue::Text(s) => Cow::Borrowed(s),
        }
    }
}

/// A check that a file (`what`: how a message names it) can be opened for
/// reading: a file the gateway reads later (a certificate, a key, a
/// secret) is checked where it is named.
pub(crate) fn readable(what: &'static str) -> impl Fn(&Path) -> Result<PathBuf, String> {
    move |path| {
        std::fs::File::open(path)
            .map(|_| path.to_owned())
            .map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
    }
}
