//! The gateway's documentation as the tests read it: the README (the first
//! screen) and every page of `docs/`, each with its path under `gateway/`.
//! A page added to `docs/` must be listed here: `every_docs_page_is_listed`
//! (in the `forward` binary) fails otherwise.

/// The README and the pages of `docs/`, in the order the README lists them.
pub const PAGES: [(&str, &str); 7] = [
    ("README.md", include_str!("../../README.md")),
    (
        "docs/configuration.md",
        include_str!("../../docs/configuration.md"),
    ),
    ("docs/channels.md", include_str!("../../docs/channels.md")),
    ("docs/operating.md", include_str!("../../docs/operating.md")),
    ("docs/queues.md", include_str!("../../docs/queues.md")),
    ("docs/security.md", include_str!("../../docs/security.md")),
    ("docs/reference.md", include_str!("../../docs/reference.md")),
];

/// The page at `path` (as in [`PAGES`]).
pub fn page(path: &str) -> &'static str {
    PAGES
        .iter()
        .find(|(p, _)| *p == path)
        .unwrap_or_else(|| panic!("{path} is not among the pages"))
        .1
}
