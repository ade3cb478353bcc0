//! Journal events dropped because the writer fell behind are counted, in
//! `Journal::dropped` and as `idempotency_journal_dropped_total`.

use idempotency_gateway::journal::{Journal, JournalEvent, JournalOptions};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower_idempotency::Outcome;

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
                    Outcome::Executed,
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

/// The channel is bounded in bytes too: a few events with large bodies fill
/// it whatever their number, and the rest are dropped and counted.
#[test]
fn the_channel_is_bounded_in_bytes() {
    let dir = std::env::temp_dir().join(format!("journal-bytes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let options = JournalOptions::new().queue_bytes(200_000);
        let (journal, writer) = Journal::open(dir.join("j.redb"), options).unwrap();
        let body = vec![0xFF_u8; 60_000];
        // The writer is not running yet: 3 bodies fit in 200,000 bytes.
        for n in 0..10 {
            let event = JournalEvent::new(
                format!("k{n}"),
                "idempotency-key",
                "/api",
                Outcome::Executed,
            );
            journal.record(event.body(&body, 64 << 10));
        }
        assert_eq!(journal.dropped(), 7);
        let writer = tokio::spawn(writer);
        journal.flush().await;
        let kept = journal.get("k2").await.unwrap().unwrap();
        assert_eq!(kept.body.as_deref(), Some(&body[..]), "bytes as given");
        assert!(journal.get("k3").await.unwrap().is_none());
        // Written, the budget is free again.
        journal.record(
            JournalEvent::new("later", "stripe", "/r", Outcome::Executed).body(&body, 64 << 10),
        );
        journal.flush().await;
        assert!(journal.get("later").await.unwrap().is_some());
        drop(journal);
        writer.await.unwrap();
    });
    let _ = std::fs::remove_dir_all(&dir);
}
