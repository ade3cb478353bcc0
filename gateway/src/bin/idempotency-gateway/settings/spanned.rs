//! Values of the config file with where they were written: an error names
//! the file and the line.

use crate::settings::parse;
use serde::Deserialize;
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

    pub(crate) fn value<T>(
        &self,
        field: &Field,
        key: &str,
        f: fn(&str) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        self.checked(field, key, |s| f(s))
    }

    /// A number from the file, checked by the flag's parser `f`.
    pub(crate) fn number(
        &self,
        field: &Option<Spanned<u64>>,
        key: &str,
        f: fn(&str) -> Result<usize, String>,
    ) -> Result<Option<usize>, String> {
        self.checked(field, key, |n| f(&n.to_string()))
    }

    pub(crate) fn size(
        &self,
        field: &Option<Spanned<SizeValue>>,
        key: &str,
    ) -> Result<Option<usize>, String> {
        self.size_by(field, key, parse::body_size)
    }

    pub(crate) fn size_by(
        &self,
        field: &Option<Spanned<SizeValue>>,
        key: &str,
        f: fn(&str) -> Result<usize, String>,
    ) -> Result<Option<usize>, String> {
        self.checked(field, key, |v| match v {
            // Bytes pass the same checks as text (`0` included).
            SizeValue::Bytes(n) => f(&n.to_string()),
            SizeValue::Text(s) => f(s),
        })
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
