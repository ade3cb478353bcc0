//! `GET /admin/journal`: the journal's records, a page at a time.

use super::{error, journal_json, json_answer, paging, parse_time, Answer, Calls, Pairs};
use axum::extract::State;
use http::StatusCode;
use idempotency_gateway::journal::JournalFilter;
use serde_json::{json, Value};

/// `?[since=T][&until=T][&route=R][&outcome=O][&limit=N][&cursor=C]`: a
/// page of records, oldest last copy first.
pub(super) async fn journal(State(calls): State<Calls>, Pairs(q): Pairs) -> Answer {
    let Some(journal) = calls.admin.journal.get() else {
        return error(StatusCode::CONFLICT, "the journal is off (--journal)");
    };
    let (limit, cursor) = match paging(&q) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e),
    };
    let mut filter = JournalFilter::default().max_records(limit);
    if let Some(cursor) = cursor {
        filter = filter.after(cursor);
    }
    for (name, value) in &q {
        filter = match name.as_str() {
            "since" | "until" => match parse_time(value) {
                Ok(ms) if name == "since" => filter.since_ms(ms),
                Ok(ms) => filter.until_ms(ms),
                Err(e) => return error(StatusCode::BAD_REQUEST, &e),
            },
            "route" => filter.route(value.as_str()),
            "outcome" => filter.outcome(value.as_str()),
            "limit" | "cursor" => filter,
            other => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("unknown parameter `{other}`"),
                )
            }
        };
    }
    match journal.page(&filter).await {
        Ok(page) => {
            let records: Vec<Value> = page.records.iter().map(journal_json).collect();
            let next = page.next.map(|c| c.to_string());
            json_answer(
                StatusCode::OK,
                &json!({ "records": records, "dropped": journal.dropped(), "next_cursor": next }),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}
