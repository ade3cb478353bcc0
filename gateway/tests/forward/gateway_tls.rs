//! HTTPS at both ends: the gateway terminates TLS with a certificate made
//! by the test (rcgen), reloads it on SIGHUP, and forwards to an `https://`
//! upstream it trusts through `--upstream-ca`.

use crate::gateway_support;
use test_support::common; // gateway_support::storm uses it

use bytes::Bytes;
use gateway_support::{temp_path, Proc};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use idempotency_gateway::proxy::Forward;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::convert::Infallible;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

/// A self-signed certificate for `localhost`: (cert PEM, key PEM).
fn certificate() -> (String, String) {
    let c = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    (c.cert.pem(), c.signing_key.serialize_pem())
}

fn write_pair(cert: &str, key: &str) -> (PathBuf, PathBuf) {
    let (c, k) = (temp_path("cert.pem"), temp_path("key.pem"));
    std::fs::write(&c, cert).unwrap();
    std::fs::write(&k, key).unwrap();
    (c, k)
}

/// An HTTPS upstream answering `ok N`; its port and call counter.
async fn tls_upstream(cert: &str, key: &str) -> (u16, Arc<AtomicUsize>) {
    let certs = vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let calls = Arc::new(AtomicUsize::new(0));
    let count = calls.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, count) = (acceptor.clone(), count.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                    let proto = req
                        .headers()
                        .get("x-forwarded-proto")
                        .map(|v| v.to_str().unwrap_or_default().to_owned())
                        .unwrap_or_default();
                    let body = format!("ok {n} via {proto}");
                    async move { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body)))) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (port, calls)
}

/// A client of `https://localhost:PORT` trusting only `ca_pem`.
fn client(port: u16, ca_pem: &str) -> Forward {
    Forward::builder(format!("https://localhost:{port}").parse().unwrap())
        .timeout(Duration::from_secs(10))
        .add_root_certificates_pem(ca_pem.as_bytes())
        .unwrap()
        .build()
}

/// Sends `req` to `https://localhost:PORT` trusting only `ca_pem` on one
/// plain HTTP/1.1 connection: unlike [`Forward`], which renames a client's
/// `Idempotency-Key` to `idempotency-client-key` on its way upstream, it sends
/// the headers as they are.
async fn send_as_is(port: u16, ca_pem: &str, mut req: Request<Full<Bytes>>) -> (u16, String) {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    req.headers_mut().insert(
        http::header::HOST,
        format!("localhost:{port}").parse().unwrap(),
    );
    let res = sender.send_request(req).await.unwrap();
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

async fn send(client: &Forward, req: Request<Full<Bytes>>) -> (u16, String) {
    let res = client.clone().oneshot(req).await.unwrap();
    let status = res.status().as_u16();
    let body = res
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn https_in_front_and_behind_with_reload_on_sighup() {
    let (up_cert, up_key) = certificate();
    let (up_port, calls) = tls_upstream(&up_cert, &up_key).await;
    let (up_ca, _) = write_pair(&up_cert, "");
    let (cert_a, key_a) = certificate();
    let (cert_path, key_path) = write_pair(&cert_a, &key_a);
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &format!("https://localhost:{up_port}"),
            "--upstream-ca",
            up_ca.to_str().unwrap(),
            "--tls-cert",
            cert_path.to_str().unwrap(),
            "--tls-key",
            key_path.to_str().unwrap(),
            "--route",
            "/api=idempotency-key",
            "--workers",
            "2",
        ],
        &[],
        Stdio::null(),
    );
    let port = gw.addr.port();
    let trusts_a = client(port, &cert_a);
    let get = || {
        Request::get("/hello")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    assert_eq!(
        send(&trusts_a, get()).await,
        (200, "ok 1 via https".to_owned())
    );

    // Guarded over TLS: the copy is replayed.
    let post = || {
        Request::post("/api/orders")
            .header("idempotency-key", "order-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    assert_eq!(send_as_is(port, &cert_a, post()).await.0, 200);
    assert_eq!(send_as_is(port, &cert_a, post()).await.0, 200);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // A client that does not trust the certificate is refused (502 from
    // the client-side forwarder: the handshake failed).
    let (cert_b, key_b) = certificate();
    let trusts_b = client(port, &cert_b);
    assert_eq!(send(&trusts_b, get()).await.0, 502);

    // New files and SIGHUP: new connections get the new certificate.
    std::fs::write(&cert_path, &cert_b).unwrap();
    std::fs::write(&key_path, &key_b).unwrap();
    gw.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let fresh = client(port, &cert_b);
        if send(&fresh, get()).await.0 == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the certificate was not reloaded within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every serving thread has it: new connections land on both.
    for _ in 0..8 {
        assert_eq!(send(&client(port, &cert_b), get()).await.0, 200);
        assert_eq!(send(&client(port, &cert_a), get()).await.0, 502);
    }

    // A bad pair on SIGHUP keeps the working one.
    std::fs::write(&key_path, "not a key").unwrap();
    gw.signal(libc::SIGHUP);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(send(&client(port, &cert_b), get()).await.0, 200);
    for p in [&up_ca, &cert_path, &key_path] {
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn tls_flags_are_checked_at_start() {
    let bin = gateway_support::gateway_bin();
    let missing = temp_path("missing.pem");
    let out = std::process::Command::new(&bin)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .args(["--tls-cert", missing.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--tls-cert without --tls-key");
    let out = std::process::Command::new(&bin)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
        ])
        .args([
            "--tls-cert",
            missing.to_str().unwrap(),
            "--tls-key",
            missing.to_str().unwrap(),
        ])
        .args(["--check-config"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");
}

/// A notification acknowledged over HTTPS and delivered later from the
/// queue tells the upstream `x-forwarded-proto: https`, as one forwarded at
/// once does: the sender's connection is known when it is queued.
#[tokio::test(flavor = "multi_thread")]
async fn a_queued_delivery_keeps_the_senders_proto() {
    let up = common::upstream::Upstream::start().await;
    let (cert, key) = certificate();
    let (cert_path, key_path) = write_pair(&cert, &key);
    let dir = temp_path("tls-ack-data");
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &up.url(),
            "--tls-cert",
            cert_path.to_str().unwrap(),
            "--tls-key",
            key_path.to_str().unwrap(),
            "--route",
            "/notify/stripe=stripe",
            "--ack-then-deliver",
            "/notify/stripe",
            "--data-dir",
            dir.to_str().unwrap(),
        ],
        &[],
        Stdio::null(),
    );
    let client = client(gw.addr.port(), &cert);
    let req = Request::post("/notify/stripe")
        .header("content-type", "application/json")
        .header("stripe-signature", "t=1,v1=00")
        .body(Full::new(Bytes::from_static(
            br#"{"id":"evt_tls_ack","object":"event","type":"charge.succeeded"}"#,
        )))
        .unwrap();
    let (status, body) = send(&client, req).await;
    assert_eq!(status, 200, "{body}");
    up.wait_for_call("/notify/stripe").await;
    let seen = up.last("/notify/stripe");
    assert_eq!(
        seen.headers
            .get("x-forwarded-proto")
            .map(|v| v.to_str().unwrap()),
        Some("https"),
        "{:?}",
        seen.headers
    );
    let forwarded_for: Vec<_> = seen.headers.get_all("x-forwarded-for").iter().collect();
    assert_eq!(forwarded_for, ["127.0.0.1"], "{:?}", seen.headers);
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
    for p in [&cert_path, &key_path] {
        let _ = std::fs::remove_file(p);
    }
}

/// The admin API's bearer token never crosses the network in clear: off
/// loopback the admin API needs `--admin-tls-cert` and `--admin-tls-key`
/// (from flags, the config file or the environment; exit 2 without), while
/// metrics alone stay plain anywhere. With them the listener speaks HTTPS
/// (with the main listener's checks), and the admin commands, given the
/// same flags, speak it too.
#[tokio::test(flavor = "multi_thread")]
async fn the_admin_api_off_loopback_needs_tls() {
    let bin = gateway_support::gateway_bin();
    let token = temp_path("admin-tls-token");
    std::fs::write(&token, "s3cret-admin-token-0123456789\n").unwrap();
    // The gateway refuses a token file that others can read.
    let owner_only = std::os::unix::fs::PermissionsExt::from_mode(0o600);
    std::fs::set_permissions(&token, owner_only).unwrap();
    let token = token.to_str().unwrap().to_owned();
    let (cert, key) = certificate();
    let (cert_path, key_path) = write_pair(&cert, &key);
    let (cert_arg, key_arg) = (
        cert_path.to_str().unwrap().to_owned(),
        key_path.to_str().unwrap().to_owned(),
    );
    let gateway = |metrics: &str| {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--metrics-listen",
            metrics,
        ]);
        cmd
    };
    for addr in ["0.0.0.0:0", "[::]:0", "192.0.2.1:9100"] {
        let mut cmd = gateway(addr);
        cmd.args(["--admin-token-file", &token]);
        gateway_support::exits_2(cmd, "--admin-tls-cert");
    }
    // Half a pair, from the environment.
    let mut cmd = gateway("0.0.0.0:0");
    cmd.args(["--admin-token-file", &token])
        .env("IDEMPOTENCY_GATEWAY_ADMIN_TLS_CERT", &cert_arg);
    gateway_support::exits_2(cmd, "--admin-tls-key");
    // A pair that does not load.
    let mut cmd = gateway("0.0.0.0:0");
    cmd.args(["--admin-token-file", &token])
        .args(["--admin-tls-cert", &cert_arg, "--admin-tls-key", &cert_arg])
        .arg("--check-config");
    gateway_support::exits_2(cmd, "private key");
    // Metrics alone stay plain on any address.
    let port = common::free_addr().port();
    let plain = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--metrics-listen",
            &format!("0.0.0.0:{port}"),
        ],
        &[],
        Stdio::null(),
    );
    let local: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(gateway_support::get(local, "/healthz").0, 200);
    drop(plain);

    // The pair from the config file: HTTPS on every address.
    let port = common::free_addr().port();
    let config = temp_path("admin-tls.toml");
    std::fs::write(
        &config,
        format!(
            "metrics_listen = \"0.0.0.0:{port}\"\nadmin_token_file = \"{token}\"\n\
             admin_tls_cert = \"{cert_arg}\"\nadmin_tls_key = \"{key_arg}\"\n"
        ),
    )
    .unwrap();
    let config_arg = config.to_str().unwrap().to_owned();
    let gw = Proc::start(
        &[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:9",
            "--config",
            &config_arg,
        ],
        &[],
        Stdio::null(),
    );
    let admin = client(port, &cert);
    let health = Request::get("/healthz")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(&admin, health).await, (200, "ok\n".to_owned()));
    let journal = Request::get("/admin/keys/evt_none")
        .header("authorization", "Bearer s3cret-admin-token-0123456789")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(&admin, journal).await.0, 200);
    // Plain HTTP gets no answer.
    let local: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert_eq!(gateway_support::get(local, "/healthz").0, 0);
    // The admin commands read the same config and speak HTTPS.
    let out = std::process::Command::new(&bin)
        .args([
            "--config",
            &config_arg,
            "inspect",
            "idem:stripe:/:-:evt_none",
        ])
        .env_remove("IDEMPOTENCY_GATEWAY_ADMIN")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(gw);
    for p in [&cert_path, &key_path, &config] {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(&token);
}
