//! Journal events dropped because the writer fell behind are counted, in
//! `Journal::dropped` and as `idempotency_journal_dropped_total`.
#![cfg(all(feature = "metrics", feature = "journal"))]

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower_idempotency::journal::{Journal, JournalEvent, JournalOptions};

#[test]
fn dropped_events_are_counted_in_the_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = std::env::temp_dir().join(format!("journal-dropped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dropped = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            // A channel of one event and a writer not running yet: the
            // second and third events find it full.
            let options = JournalOptions::new().capacity(1);
            let (journal, writer) = Journal::open(dir.join("j.redb"), options).unwrap();
            for n in 0..3 {
                journal.record(JournalEvent::new(
                    format!("k{n}"),
                    "stripe",
                    "/r",
                    "executed",
                ));
            }
            let dropped = journal.dropped();
            let writer = tokio::spawn(writer);
            journal.flush().await;
            assert!(
                journal.get("k0").await.unwrap().is_some(),
                "the first was written"
            );
            assert!(journal.get("k1").await.unwrap().is_none());
            drop(journal);
            writer.await.unwrap();
            dropped
        })
    });
    assert_eq!(dropped, 2);
    let counted: u64 = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_journal_dropped_total")
        .map(|(.., value)| match value {
            DebugValue::Counter(n) => n,
            other => panic!("not a counter: {other:?}"),
        })
        .sum();
    assert_eq!(counted, 2);
    let _ = std::fs::remove_dir_all(&dir);
}
