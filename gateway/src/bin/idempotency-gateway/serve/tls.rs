//! HTTPS at the gateway: a PEM certificate chain and key, reloaded on
//! SIGHUP (a bad new pair is logged and the old one kept).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use tokio_rustls::TlsAcceptor;
use tracing::{info, warn};

/// The current TLS configuration; clones share it.
#[derive(Clone)]
pub(crate) struct Tls {
    files: Arc<(PathBuf, PathBuf)>,
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl Tls {
    /// Loads `cert` and `key`; `Err` says which file is wrong.
    pub(crate) fn load(cert: &Path, key: &Path) -> Result<Self, String> {
        let config = server_config(cert, key)?;
        Ok(Self {
            files: Arc::new((cert.to_owned(), key.to_owned())),
            current: Arc::new(RwLock::new(Arc::new(config))),
        })
    }

    /// An acceptor with the current configuration.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        let config = self
            .current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        TlsAcceptor::from(config)
    }
}

/// On every SIGHUP, for as long as the process runs: reloads the files of
/// each of `tls` (the main listener's, the metrics listener's), or logs that
/// there is nothing to reload. SIGHUP never stops the gateway.
pub(crate) fn reload_on_sighup(tls: Vec<Tls>) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            if tls.is_empty() {
                info!("SIGHUP: nothing to reload (no TLS certificate)");
            }
            for tls in &tls {
                let (cert, key) = &*tls.files;
                match server_config(cert, key) {
                    Ok(config) => {
                        *tls.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
                        info!(cert = %cert.display(), "TLS certificate reloaded");
                    }
                    Err(error) => warn!(%error, "TLS reload failed; keeping the old certificate"),
                }
            }
        }
    });
    Ok(())
}

fn server_config(cert: &Path, key: &Path) -> Result<ServerConfig, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect)
        .map_err(|e| format!("cannot read the certificate {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("cannot read the private key {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("the certificate and key do not go together: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
