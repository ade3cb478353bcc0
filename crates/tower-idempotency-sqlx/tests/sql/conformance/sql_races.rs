//! Interleavings of the SQL store with other sessions on the same real
//! database: a sweep that meets a row made live while it ran, a claim whose
//! caller gave up while the server still ran it, a session whose time zone
//! steps back.

use super::sql_setup;
use super::*;
use tower_idempotency::store::ActiveClaim;
use tower_idempotency_sqlx::{CompleteIn, SqlStore};

/// Waits until `probe` says the sweep waits on a lock, or the sweep ended
/// (a sweep that skips locked rows never waits); 10 s at most.
async fn until_blocked_or_done<T>(
    sweep: &tokio::task::JoinHandle<T>,
    mut probe: impl AsyncFnMut() -> bool,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !sweep.is_finished() && !probe().await {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweep neither ended nor waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spawn_sweep(store: &SqlStore) -> tokio::task::JoinHandle<u64> {
    let store = store.clone();
    tokio::spawn(async move { store.sweep_expired(1000).await.unwrap() })
}

/// A claim (by `owner`, with a lease of 50 ms) whose lease has run out: the
/// sweep may delete it.
async fn expired_claim(store: &SqlStore, case: &str) -> (String, OwnerToken) {
    let key = unique_key(case);
    let owner = OwnerToken::new();
    assert_acquired(
        &store
            .claim(&key, fp("s"), owner, Duration::from_millis(50))
            .await
            .unwrap(),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    (key, owner)
}

fn active(key: &str, owner: OwnerToken) -> ActiveClaim {
    ActiveClaim::new(key.into(), owner, fp("s"), WINDOW)
}

const PG_SWEEP_WAITS: &str = "SELECT count(*) FROM pg_stat_activity
    WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM idempotency_records%'";

/// PostgreSQL: session 1 takes over an aged released row (a claim) or
/// completes an expired in-flight one (`complete_in`) and holds it; session 2
/// sweeps (its subquery chose the row on the old version); session 1
/// commits. The row session 1 made live must survive the sweep, or a second
/// copy claims an absent key and runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sweep_spares_a_row_made_live_while_it_runs() {
    let Some((store, _g)) = sql_setup::postgres().await else {
        return;
    };
    let store = store.sweep(None, 1000);
    let pool = store.as_postgres().unwrap().clone();
    let blocked = async || {
        let n: i64 = sqlx::query_scalar(PG_SWEEP_WAITS)
            .fetch_one(&pool)
            .await
            .unwrap();
        n > 0
    };

    // A completion committing on an expired in-flight row.
    let (key, owner) = expired_claim(&store, "sweep-race-complete").await;
    let mut tx = pool.begin().await.unwrap();
    let rec = record(fp("s"), false, false);
    assert!(active(&key, owner)
        .complete_in(&mut tx, &rec.response)
        .await
        .unwrap());
    let sweep = spawn_sweep(&store);
    until_blocked_or_done(&sweep, blocked).await;
    tx.commit().await.unwrap();
    sweep.await.unwrap();
    let after = store
        .claim(&key, fp("s"), OwnerToken::new(), LEASE)
        .await
        .unwrap();
    assert!(
        matches!(after, Claim::Completed(_)),
        "the sweep deleted a record completed while it ran: the next copy got {after:?}"
    );

    // A claim taking over a released row that the sweep may delete (a
    // minute past its release): the claim's update, held open.
    let key = unique_key("sweep-race-claim");
    let first = OwnerToken::new();
    store.claim(&key, fp("s"), first, LEASE).await.unwrap();
    assert!(store.release(&key, first).await.unwrap());
    sqlx::query(
        "UPDATE idempotency_records SET expires_at = expires_at - 120000 WHERE idem_key = $1",
    )
    .bind(key.as_bytes())
    .execute(&pool)
    .await
    .unwrap();
    let taker = OwnerToken::new();
    let mut tx = pool.begin().await.unwrap();
    let took = sqlx::query(
        "UPDATE idempotency_records SET state = 1, owner_token = $2, fingerprint = $3,
            fence = fence + 1, lease_until = expires_at + 300000, expires_at = expires_at + 300000
        WHERE idem_key = $1 AND state = 0",
    )
    .bind(key.as_bytes())
    .bind(&taker.as_u128().to_be_bytes()[..])
    .bind(&fp("taker").to_bytes()[..])
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(took.rows_affected(), 1);
    let sweep = spawn_sweep(&store);
    until_blocked_or_done(&sweep, blocked).await;
    tx.commit().await.unwrap();
    sweep.await.unwrap();
    let after = store
        .claim(&key, fp("taker"), OwnerToken::new(), LEASE)
        .await
        .unwrap();
    assert!(
        matches!(after, Claim::InFlight { .. }),
        "the sweep deleted a claim made while it ran: a second copy got {after:?}"
    );
}

const MY_SWEEP_WAITS: &str = "SELECT count(*) FROM information_schema.processlist
    WHERE info LIKE 'DELETE FROM idempotency_records%'";

/// MariaDB: the same interleaving (its `DELETE` re-reads the row it waited
/// for, so it must hold there too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_sweep_spares_a_row_made_live_while_it_runs() {
    let Some((store, _g)) = sql_setup::mariadb().await else {
        return;
    };
    let store = store.sweep(None, 1000);
    let pool = store.as_mysql().unwrap().clone();
    let blocked = async || {
        let n: i64 = sqlx::query_scalar(MY_SWEEP_WAITS)
            .fetch_one(&pool)
            .await
            .unwrap();
        n > 0
    };
    let (key, owner) = expired_claim(&store, "sweep-race-complete").await;
    let mut tx = pool.begin().await.unwrap();
    let rec = record(fp("s"), false, false);
    assert!(active(&key, owner)
        .complete_in(&mut tx, &rec.response)
        .await
        .unwrap());
    let sweep = spawn_sweep(&store);
    until_blocked_or_done(&sweep, blocked).await;
    tx.commit().await.unwrap();
    sweep.await.unwrap();
    let after = store
        .claim(&key, fp("s"), OwnerToken::new(), LEASE)
        .await
        .unwrap();
    assert!(
        matches!(after, Claim::Completed(_)),
        "the sweep deleted a record completed while it ran: the next copy got {after:?}"
    );
}

/// PostgreSQL: the layer's store timeout gives up on a claim that the
/// server still runs (it waits on a lock here); the layer's guard releases
/// at once, on another connection, and finds nothing. The claim then
/// commits: nobody owns it, and it must not block the key for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_claim_given_up_on_is_released_after_it_commits() {
    let Some((store, _g)) = sql_setup::postgres().await else {
        return;
    };
    let pool = store.as_postgres().unwrap().clone();
    let key = unique_key("timed-out-claim");
    // Another session's insert of the key, not committed yet: the claim waits.
    let mut holder = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_records (idem_key, state, fence, created_at, expires_at)
        VALUES ($1, 0, 1, 0, 0)",
    )
    .bind(key.as_bytes())
    .execute(&mut *holder)
    .await
    .unwrap();
    let owner = OwnerToken::new();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        store.claim(&key, fp("t"), owner, LEASE),
    )
    .await;
    assert!(gave_up.is_err(), "the claim did not wait: {gave_up:?}");
    // What the layer's guard does when the claim call timed out.
    assert!(!store.release(&key, owner).await.unwrap());
    holder.rollback().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match store
            .claim(&key, fp("t"), OwnerToken::new(), LEASE)
            .await
            .unwrap()
        {
            Claim::Acquired(_) => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "a claim nobody owns blocks the key: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// MariaDB: the store's clock is the Unix time whatever the session's time
/// zone: a session in a zone with summer time, in the hour that repeats in
/// the autumn, and sessions at fixed offsets either side of UTC all write
/// the same `created_at` for the same instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_clock_ignores_the_session_time_zone() {
    let Some(server) = super::support_sql::shared_mariadb() else {
        return;
    };
    // Named zones need the time zone tables: load Europe/Berlin.
    let mut zones = vec!["+05:00", "-07:00", "+00:00"];
    let tz = std::process::Command::new("mariadb-tzinfo-to-sql")
        .args(["/usr/share/zoneinfo/Europe/Berlin", "Europe/Berlin"])
        .output();
    match tz {
        Ok(out) if out.status.success() => {
            let pool = sqlx::mysql::MySqlPool::connect(server.url()).await.unwrap();
            let sql = String::from_utf8(out.stdout).unwrap();
            let sql = format!("USE mysql;\n{sql}");
            sqlx::raw_sql(&sql).execute(&pool).await.unwrap();
            zones.push("Europe/Berlin");
        }
        _ => eprintln!("WARNING: mariadb-tzinfo-to-sql failed: no named zone tested"),
    }
    // 2023-10-29 02:30 in Berlin, twice: 00:30 UTC (summer time) and 01:30
    // UTC (winter time).
    for instant in [1_698_539_400_i64, 1_698_543_000] {
        for zone in &zones {
            let set = format!("SET time_zone = '{zone}', timestamp = {instant}.25");
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(2)
                .after_connect(move |conn, _| {
                    let set = set.clone();
                    Box::pin(async move {
                        sqlx::Executor::execute(conn, set.as_str()).await?;
                        Ok(())
                    })
                })
                .connect(server.url())
                .await
                .unwrap();
            let store = SqlStore::mysql(pool.clone()).await.unwrap().sweep(None, 1);
            let key = unique_key("tz");
            assert_acquired(&claim(&store, &key, fp("z"), LEASE).await);
            let created: i64 =
                sqlx::query_scalar("SELECT created_at FROM idempotency_records WHERE idem_key = ?")
                    .bind(key.as_bytes())
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(
                created,
                instant * 1000 + 250,
                "session time zone {zone}: the clock is off by {} s",
                (created - instant * 1000 - 250) / 1000
            );
        }
    }
}

/// PostgreSQL: `forget` racing the owner's completion answers what was
/// there, never `Absent` for a key that was in flight or completed all
/// along (a storm of races; the count of wrong answers is printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_forget_racing_a_completion_never_answers_absent() {
    let Some((store, _g)) = sql_setup::postgres().await else {
        return;
    };
    let mut absent = 0;
    let rounds = 300;
    for i in 0..rounds {
        let key: Arc<str> = unique_key(&format!("forget-race-{i}")).into();
        let owner = OwnerToken::new();
        assert_acquired(&store.claim(&key, fp("f"), owner, LEASE).await.unwrap());
        let (s1, k1) = (store.clone(), key.clone());
        let done = tokio::spawn(async move {
            s1.complete(&k1, owner, record(fp("f"), false, false), WINDOW)
                .await
                .unwrap()
        });
        let forgot = store.forget(&key).await.unwrap();
        assert!(done.await.unwrap());
        if forgot == Forgotten::Absent {
            absent += 1;
        }
    }
    assert_eq!(
        absent, 0,
        "{absent} of {rounds} forgets answered Absent for a key in flight or completed"
    );
}

/// PostgreSQL (a server of its own, so that its counters are this test's):
/// 1,000 keys in flight, each with a waiting duplicate on this instance.
/// Their look-out must cost one statement per tick for all of them, not one
/// per key (40,000 a second on a pool of 10 connections), so that the
/// owners' renewals keep their leases: counts the transactions the database
/// committed over 3 s and the renewals that came late.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_thousand_waited_keys_leave_the_renewals_on_time() {
    if !super::support_sql::postgres_available() {
        return;
    }
    let server = super::support_sql::DbServer::postgres();
    let store = SqlStore::connect(server.url())
        .await
        .unwrap()
        .sweep(None, 1000);
    const KEYS: usize = 1000;
    let lease = Duration::from_secs(30);
    // The layer renews every lease/3; here every second, each renewal
    // due within that second.
    let every = Duration::from_secs(1);
    let mut owners = Vec::new();
    for i in 0..KEYS {
        let key = unique_key(&format!("watched-{i}"));
        let owner = OwnerToken::new();
        assert_acquired(&store.claim(&key, fp("w"), owner, lease).await.unwrap());
        owners.push((key, owner));
    }
    let mut waiters = Vec::new();
    for (key, _) in &owners {
        let Claim::InFlight { watch, .. } = claim(&store, key, fp("w"), lease).await else {
            panic!("expected InFlight");
        };
        waiters.push(tokio::spawn(watch.changed()));
    }
    let commits = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(store.as_postgres().unwrap())
        .await
        .unwrap();
        n
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The waiters alone (the database's counters may lag behind by a
    // second, never ahead).
    let before = commits().await;
    let start = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_second = (commits().await - before) as f64 / start.elapsed().as_secs_f64();
    // Three rounds of renewals, as the layer renews.
    let mut late = 0;
    for _ in 0..3 {
        let round = std::time::Instant::now();
        let renewals = owners.iter().map(|(key, owner)| {
            let store = store.clone();
            let (key, owner) = (key.clone(), *owner);
            tokio::spawn(async move {
                tokio::time::timeout(every, store.renew(&key, owner, lease)).await
            })
        });
        for r in renewals.collect::<Vec<_>>() {
            if !matches!(r.await.unwrap(), Ok(Ok(true))) {
                late += 1;
            }
        }
        tokio::time::sleep(every.saturating_sub(round.elapsed())).await;
    }
    eprintln!(
        "{KEYS} waited keys: {per_second:.0} statements a second; {late} of {} renewals late",
        3 * KEYS
    );
    assert_eq!(late, 0, "renewals that took longer than {every:?}");
    assert!(
        per_second < 1000.0,
        "the waiters' look-out ran {per_second:.0} statements a second"
    );
    drop(waiters);
}
