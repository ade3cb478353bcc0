//! Completion in the business transaction (`ActiveClaim::complete_in`),
//! tested by killing the process that runs the handler: a child process (this
//! test binary, re-run with `SQL_CRASH_URL` set) takes a notification through
//! the key and dedup layers over a `SqlStore`, writes a business row and the
//! record in one transaction, and is killed with SIGKILL right before or
//! right after its commit. The retries then run in this process, over the same
//! database: the business row must exist exactly once.

use test_support::support_sql;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support_sql::{shared_postgres, SqliteFile};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::dedup::DedupLayer;
use tower_idempotency::key::{Field, FingerprintSpec, KeyLayer, KeySpec};
use tower_idempotency::store::{ActiveClaim, StoredResponse};
use tower_idempotency_sqlx::{CompleteIn, SqlStore};

/// Short, so that the retry after a crash before the commit takes over soon.
const LEASE: Duration = Duration::from_millis(1500);

/// Where the child stops for its parent to kill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Abort {
    BeforeCommit,
    AfterCommit,
    Never,
}

impl Abort {
    fn name(self) -> &'static str {
        match self {
            Abort::BeforeCommit => "before-commit",
            Abort::AfterCommit => "after-commit",
            Abort::Never => "never",
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "before-commit" => Abort::BeforeCommit,
            "after-commit" => Abort::AfterCommit,
            _ => Abort::Never,
        }
    }
}

/// How the handler records its success.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `claim.complete_in(&mut tx, …)` before the commit.
    InTransaction,
    /// The business write alone; the layer records the success afterwards.
    ByTheLayer,
}

/// The business table: no unique index on purpose, so a second run shows.
async fn business_schema(store: &SqlStore) {
    let ddl =
        "CREATE TABLE IF NOT EXISTS payments (notify_id TEXT NOT NULL, amount BIGINT NOT NULL)";
    if let Some(pool) = store.as_postgres() {
        sqlx::query(ddl).execute(pool).await.unwrap();
    } else if let Some(pool) = store.as_sqlite() {
        sqlx::query(ddl).execute(pool).await.unwrap();
    }
}

async fn payments(store: &SqlStore, notify_id: &str) -> i64 {
    if let Some(pool) = store.as_postgres() {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE notify_id = $1")
            .bind(notify_id)
            .fetch_one(pool)
            .await
            .unwrap()
    } else {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE notify_id = ?1")
            .bind(notify_id)
            .fetch_one(store.as_sqlite().unwrap())
            .await
            .unwrap()
    }
}

fn response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "text/plain".parse().unwrap());
    StoredResponse::new(StatusCode::OK, headers, Bytes::from_static(b"paid"))
}

/// Stops here until killed, after telling the parent where.
fn mark(at: Abort) -> ! {
    let mut out = std::io::stdout().lock();
    writeln!(out, "MARK {}", at.name()).unwrap();
    out.flush().unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// The handler: one transaction with the business row and (in
/// `InTransaction` mode) the record.
async fn pay(
    store: SqlStore,
    req: Request<Full<Bytes>>,
    mode: Mode,
    abort: Abort,
    runs: Arc<AtomicUsize>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    runs.fetch_add(1, Ordering::SeqCst);
    let claim = req
        .extensions()
        .get::<ActiveClaim>()
        .expect("the dedup layer puts the claim into the extensions")
        .clone();
    let notify_id = req.headers()["idempotency-key"]
        .to_str()
        .unwrap()
        .to_owned();
    let response = response();
    macro_rules! body {
        ($tx:ident, $insert:literal) => {{
            sqlx::query($insert)
                .bind(&notify_id)
                .bind(1999_i64)
                .execute(&mut *$tx)
                .await
                .unwrap();
            if mode == Mode::InTransaction {
                assert!(claim.complete_in(&mut $tx, &response).await.unwrap());
            }
            if abort == Abort::BeforeCommit {
                mark(abort);
            }
            $tx.commit().await.unwrap();
        }};
    }
    if let Some(pool) = store.as_postgres() {
        let mut tx = pool.begin().await.unwrap();
        body!(
            tx,
            "INSERT INTO payments (notify_id, amount) VALUES ($1, $2)"
        );
    } else {
        let pool = store.as_sqlite().unwrap();
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
        body!(
            tx,
            "INSERT INTO payments (notify_id, amount) VALUES (?1, ?2)"
        );
    }
    if abort == Abort::AfterCommit {
        mark(abort);
    }
    let mut res = Response::new(Full::new(response.body.clone()));
    *res.headers_mut() = response.headers.clone();
    Ok(res)
}

/// One delivery of notification `notify_id` through key + dedup layers.
async fn deliver(
    store: &SqlStore,
    notify_id: &str,
    mode: Mode,
    abort: Abort,
    runs: &Arc<AtomicUsize>,
) -> (StatusCode, bool, Bytes) {
    let handler_store = store.clone();
    let runs = runs.clone();
    let svc = ServiceBuilder::new()
        .layer(KeyLayer::new(KeySpec::new(
            [Field::header(http::HeaderName::from_static(
                "idempotency-key",
            ))],
            FingerprintSpec::Request,
        )))
        .layer(
            DedupLayer::new(store.clone())
                .lease(LEASE)
                .wait(Duration::from_millis(300)),
        )
        .service(service_fn(move |req| {
            pay(handler_store.clone(), req, mode, abort, runs.clone())
        }));
    let req = Request::post("/notify")
        .header("idempotency-key", notify_id)
        .body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let status = res.status();
    (
        status,
        replayed,
        res.into_body().collect().await.unwrap().to_bytes(),
    )
}

/// The child's side: one delivery, killed at its mark.
#[tokio::test]
async fn child_process() {
    let Ok(url) = std::env::var("SQL_CRASH_URL") else {
        return; // only when re-run by a test below
    };
    let abort = Abort::parse(&std::env::var("SQL_CRASH_AT").unwrap());
    let mode = if std::env::var("SQL_CRASH_MODE").unwrap() == "layer" {
        Mode::ByTheLayer
    } else {
        Mode::InTransaction
    };
    let notify_id = std::env::var("SQL_CRASH_KEY").unwrap();
    let store = SqlStore::connect(&url).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (status, _, _) = deliver(&store, &notify_id, mode, abort, &runs).await;
    println!("DONE {status}");
}

/// Runs a child that delivers `notify_id` and kills it with SIGKILL at its
/// mark; returns the mark it reached.
fn crash_child(url: &str, notify_id: &str, mode: Mode, abort: Abort) -> String {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &child_test(), "--nocapture", "--test-threads=1"])
        .env("SQL_CRASH_URL", url)
        .env("SQL_CRASH_AT", abort.name())
        .env("SQL_CRASH_KEY", notify_id)
        .env(
            "SQL_CRASH_MODE",
            if mode == Mode::ByTheLayer {
                "layer"
            } else {
                "tx"
            },
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut reached = String::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        // libtest prints `test child_process ... ` first, on the same line.
        if let Some((_, at)) = line.split_once("MARK ") {
            reached = at.trim().to_owned();
            break;
        }
    }
    // Child::kill is SIGKILL on Unix: no destructor, no rollback, no
    // completion by the layer.
    let _ = child.kill();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was not killed: {status}");
    reached
}

/// Retries (as the channel would) until one is answered 200; returns the
/// last answer.
async fn retry_until_ok(
    store: &SqlStore,
    notify_id: &str,
    mode: Mode,
    runs: &Arc<AtomicUsize>,
) -> (StatusCode, bool, Bytes) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let answer = deliver(store, notify_id, mode, Abort::Never, runs).await;
        if answer.0 == StatusCode::OK || Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Kills a child at `abort`, retries here, and returns (business rows,
/// handler runs here, the answer).
async fn crash_then_retry(
    store: &SqlStore,
    url: &str,
    mode: Mode,
    abort: Abort,
) -> (i64, usize, (StatusCode, bool, Bytes)) {
    business_schema(store).await;
    let notify_id = format!(
        "EV-{}-{:x}",
        abort.name(),
        tower_idempotency::store::OwnerToken::new().as_u128()
    );
    let url = url.to_owned();
    let key = notify_id.clone();
    let reached = tokio::task::spawn_blocking(move || crash_child(&url, &key, mode, abort))
        .await
        .unwrap();
    assert_eq!(reached, abort.name(), "the child never reached its mark");
    let runs = Arc::new(AtomicUsize::new(0));
    let answer = retry_until_ok(store, &notify_id, mode, &runs).await;
    assert_eq!(answer.0, StatusCode::OK, "{answer:?}");
    // A few more copies, as the channel sends them.
    for _ in 0..3 {
        let again = deliver(store, &notify_id, mode, Abort::Never, &runs).await;
        assert_eq!((again.0, again.1), (StatusCode::OK, true), "{again:?}");
    }
    let rows = payments(store, &notify_id).await;
    (rows, runs.load(Ordering::SeqCst), answer)
}

async fn both_abort_points(store: SqlStore, url: &str) {
    // Killed before the commit: neither the payment nor the record exists;
    // once the dead owner's lease ends, a retry runs the handler, once.
    let (rows, runs, answer) =
        crash_then_retry(&store, url, Mode::InTransaction, Abort::BeforeCommit).await;
    assert_eq!(rows, 1, "business rows after a crash before the commit");
    assert_eq!(runs, 1, "the retry must run the handler once");
    assert!(!answer.1, "nothing to replay: {answer:?}");
    // Killed after the commit: both exist; every retry replays, none runs.
    let (rows, runs, answer) =
        crash_then_retry(&store, url, Mode::InTransaction, Abort::AfterCommit).await;
    assert_eq!(rows, 1, "business rows after a crash after the commit");
    assert_eq!(runs, 0, "the retry must replay, not run");
    assert!(answer.1, "replayed: {answer:?}");
    assert_eq!(answer.2, "paid");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_crash_at_either_side_of_the_commit_pays_once() {
    let Some(server) = shared_postgres() else {
        return;
    };
    let store = SqlStore::connect(server.url()).await.unwrap();
    both_abort_points(store, server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_crash_at_either_side_of_the_commit_pays_once() {
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    both_abort_points(store, &file.url()).await;
}

/// Without `complete_in`, the layer records the success after the handler's
/// commit: a crash in between runs the handler again. This is the window
/// that completing in the transaction closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_without_complete_in_a_crash_after_the_commit_pays_twice() {
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    let (rows, runs, _) =
        crash_then_retry(&store, &file.url(), Mode::ByTheLayer, Abort::AfterCommit).await;
    assert_eq!(
        (rows, runs),
        (2, 1),
        "the crash window of a record written after the commit"
    );
}

/// The layer does not complete a record the handler completed: the first
/// answer and every replay agree, and the record is the handler's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_leaves_the_handlers_record_alone() {
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    business_schema(&store).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let first = deliver(&store, "EV-plain", Mode::InTransaction, Abort::Never, &runs).await;
    assert_eq!(
        (first.0, first.1, &first.2[..]),
        (StatusCode::OK, false, &b"paid"[..])
    );
    for _ in 0..3 {
        let again = deliver(&store, "EV-plain", Mode::InTransaction, Abort::Never, &runs).await;
        assert_eq!(
            (again.0, again.1, &again.2[..]),
            (StatusCode::OK, true, &b"paid"[..])
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(payments(&store, "EV-plain").await, 1);
}

/// A guarded route whose handler is `handler`, over `store`, with a short
/// lease (renewed every 200 ms).
fn route<St, F, Fut>(
    store: St,
    handler: F,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    Error = std::convert::Infallible,
    Future = impl Send,
> + Clone
where
    St: tower_idempotency::store::Store,
    F: Fn(ActiveClaim) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = StatusCode> + Send + 'static,
{
    ServiceBuilder::new()
        .layer(KeyLayer::new(KeySpec::new(
            [Field::header(http::HeaderName::from_static(
                "idempotency-key",
            ))],
            FingerprintSpec::Request,
        )))
        .layer(
            DedupLayer::new(store)
                .lease(Duration::from_millis(600))
                .wait(Duration::from_millis(300)),
        )
        .service(service_fn(move |req: Request<Full<Bytes>>| {
            let handler = handler.clone();
            async move {
                let claim = req.extensions().get::<ActiveClaim>().unwrap().clone();
                let status = handler(claim).await;
                let mut res = Response::new(Full::new(Bytes::from_static(b"paid")));
                *res.status_mut() = status;
                Ok::<_, std::convert::Infallible>(res)
            }
        }))
}

fn notify(id: &str) -> Request<Full<Bytes>> {
    Request::post("/notify")
        .header("idempotency-key", id)
        .body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
        .unwrap()
}

/// The handler completed the record in its transaction, the transaction did
/// not commit (here: rolled back, as a failed `COMMIT` leaves it), and the
/// handler answers 2xx anyway: the channel must not hear a success, and the
/// next copy runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_transaction_did_not_commit_is_no_success() {
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (pool, counted) = (store.as_sqlite().unwrap().clone(), runs.clone());
    let svc = route(store.clone(), move |claim: ActiveClaim| {
        let (pool, runs) = (pool.clone(), counted.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
            assert!(claim.complete_in(&mut tx, &response()).await.unwrap());
            tx.rollback().await.unwrap();
            StatusCode::OK
        }
    });
    let first = svc.clone().oneshot(notify("EV-uncommitted")).await.unwrap();
    assert_ne!(
        first.status(),
        StatusCode::OK,
        "a success answered for a record that was never committed"
    );
    let again = svc.oneshot(notify("EV-uncommitted")).await.unwrap();
    assert_ne!(again.status(), StatusCode::OK);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the next copy must run");
}

/// `complete_in` on a database where the layer holds no claim (the layer's
/// store is a memory store here, or another database) must fail loudly: a
/// row written there is not the layer's record, and the next copy would run
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_without_the_claims_row_fails_loudly() {
    let file = SqliteFile::new();
    let sql = SqlStore::connect(&file.url()).await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (pool, log) = (sql.as_sqlite().unwrap().clone(), seen.clone());
    let svc = route(
        tower_idempotency::store::MemoryStore::new(),
        move |claim: ActiveClaim| {
            let (pool, log) = (pool.clone(), log.clone());
            async move {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                let done = claim.complete_in(&mut tx, &response()).await;
                let ok = matches!(done, Ok(true));
                log.lock().unwrap().push(done.map_err(|e| e.to_string()));
                if ok {
                    tx.commit().await.unwrap();
                    StatusCode::OK
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            }
        },
    );
    svc.oneshot(notify("EV-foreign")).await.unwrap();
    let seen = seen.lock().unwrap();
    assert!(
        matches!(&seen[..], [Err(_)]),
        "complete_in where the layer holds no claim answered {seen:?}"
    );
}

/// PostgreSQL at REPEATABLE READ: the layer renews the lease (an update of
/// the claim's row) while the handler works, so the handler's completion
/// would fail with a serialization error once it is slower than lease/3.
/// `complete_in` refuses such a transaction at once with an error that says
/// what to do, fast or slow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_complete_in_refuses_repeatable_read_clearly() {
    let Some(server) = shared_postgres() else {
        return;
    };
    let store = SqlStore::connect(server.url()).await.unwrap();
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (pool, log) = (store.as_postgres().unwrap().clone(), seen.clone());
        let svc = route(store.clone(), move |claim: ActiveClaim| {
            let (pool, log) = (pool.clone(), log.clone());
            async move {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}"))
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                // The snapshot is taken here; renewals follow.
                sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
                let done = claim.complete_in(&mut tx, &response()).await;
                log.lock().unwrap().push(done.map_err(|e| e.to_string()));
                StatusCode::INTERNAL_SERVER_ERROR
            }
        });
        let id = format!(
            "EV-rr-{:x}",
            tower_idempotency::store::OwnerToken::new().as_u128()
        );
        svc.oneshot(notify(&id)).await.unwrap();
        let seen = seen.lock().unwrap();
        assert!(
            matches!(&seen[..], [Err(e)] if e.contains("READ COMMITTED")),
            "{level}: {seen:?}"
        );
    }
}

/// A client token consumed by a request whose transaction rolled back is
/// given back: the client's retry with the same token runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_consumed_in_a_rolled_back_transaction_is_given_back() {
    use tower_idempotency::token::IssueToken;
    use tower_idempotency::{IdempotencyLayer, Preset};
    let file = SqliteFile::new();
    let store = SqlStore::connect(&file.url()).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (pool, counted) = (store.as_sqlite().unwrap().clone(), runs.clone());
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::new_in(
            Preset::client_token(),
            store.clone(),
        ))
        .service(service_fn(move |req: Request<Full<Bytes>>| {
            let (pool, runs) = (pool.clone(), counted.clone());
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst);
                let claim = req.extensions().get::<ActiveClaim>().unwrap().clone();
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
                assert!(claim.complete_in(&mut tx, &response()).await.unwrap());
                let status = if n == 0 {
                    // The business write failed after the record was written.
                    tx.rollback().await.unwrap();
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    tx.commit().await.unwrap();
                    StatusCode::CREATED
                };
                let mut res = Response::new(Full::new(Bytes::from_static(b"paid")));
                *res.status_mut() = status;
                Ok::<_, std::convert::Infallible>(res)
            }
        }));
    let issuer = IssueToken::new(store.clone());
    let issued = issuer
        .oneshot(
            Request::get("/orders/token")
                .header("authorization", "Bearer alice")
                .body(())
                .unwrap(),
        )
        .await
        .unwrap();
    let body = issued.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let token = v["token"].as_str().unwrap().to_owned();
    let submit = || {
        Request::post("/orders")
            .header("idempotency-token", &token)
            .header("authorization", "Bearer alice")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"sku\":\"tea\"}")))
            .unwrap()
    };
    let first = svc.clone().oneshot(submit()).await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let second = svc.oneshot(submit()).await.unwrap();
    assert_eq!(
        second.status(),
        StatusCode::CREATED,
        "the token consumed in the rolled-back transaction was not given back"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// The full name of this file's `child_process` test, as the test binary
/// takes it (`--exact`): its module path without the binary's name.
fn child_test() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::child_process")
}
