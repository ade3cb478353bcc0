//! Public keys from PEM, DER or the bare base64 some channels hand out.

use ring::signature::{UnparsedPublicKey, RSA_PKCS1_2048_8192_SHA256};
use std::fmt;
use x509_cert::der::{Decode, DecodePem};
use x509_cert::spki::SubjectPublicKeyInfoOwned;
use x509_cert::Certificate;

/// The OID of `rsaEncryption`.
const RSA_ENCRYPTION: &str = "1.2.840.113549.1.1.1";

/// A signing key or secret that cannot be read (a configuration error, at
/// start): not the idempotency key of a request, whose errors are
/// [`key::KeyError`](crate::key::KeyError).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningKeyError(String);

impl SigningKeyError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for SigningKeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SigningKeyError {}

/// An RSA public key that verifies SHA256withRSA (PKCS#1 v1.5) signatures,
/// 2048 to 8192 bits.
#[derive(Clone)]
pub struct RsaPublicKey {
    /// The PKCS#1 `RSAPublicKey` DER, the form `ring` verifies with.
    pkcs1: Vec<u8>,
}

impl fmt::Debug for RsaPublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RsaPublicKey")
            .field("bytes", &self.pkcs1.len())
            .finish()
    }
}

impl RsaPublicKey {
    /// Reads a key from an X.509 certificate or a `PUBLIC KEY` (SPKI) in PEM,
    /// DER, or bare base64 of the DER (the way Alipay shows its public key).
    pub fn from_pem_or_der(input: impl AsRef<[u8]>) -> Result<Self, SigningKeyError> {
        let input = input.as_ref();
        let text = std::str::from_utf8(input).ok().map(str::trim);
        let spki = match text {
            Some(t) if t.starts_with("-----BEGIN CERTIFICATE-----") => {
                Certificate::from_pem(t)
                    .map_err(|e| SigningKeyError::new(format!("certificate: {e}")))?
                    .tbs_certificate
                    .subject_public_key_info
            }
            Some(t) if t.starts_with("-----BEGIN PUBLIC KEY-----") => {
                SubjectPublicKeyInfoOwned::from_pem(t)
                    .map_err(|e| SigningKeyError::new(format!("public key: {e}")))?
            }
            Some(t) if t.starts_with("-----BEGIN") => {
                return Err(SigningKeyError::new(
                    "expected a CERTIFICATE or PUBLIC KEY PEM block",
                ))
            }
            Some(t) if !t.is_empty() && t.bytes().all(is_base64_byte) => {
                use base64::Engine;
                let compact: String = t.split_whitespace().collect();
                let der = base64::engine::general_purpose::STANDARD
                    .decode(compact)
                    .map_err(|_| SigningKeyError::new("public key: not base64"))?;
                return Self::from_der(&der);
            }
            _ => return Self::from_der(input),
        };
        Self::from_spki(&spki)
    }

    /// Reads a key from the DER of a certificate or a SubjectPublicKeyInfo.
    pub fn from_der(der: &[u8]) -> Result<Self, SigningKeyError> {
        if let Ok(spki) = SubjectPublicKeyInfoOwned::from_der(der) {
            return Self::from_spki(&spki);
        }
        let cert = Certificate::from_der(der)
            .map_err(|_| SigningKeyError::new("expected a certificate or public key (DER)"))?;
        Self::from_spki(&cert.tbs_certificate.subject_public_key_info)
    }

    fn from_spki(spki: &SubjectPublicKeyInfoOwned) -> Result<Self, SigningKeyError> {
        if spki.algorithm.oid.to_string() != RSA_ENCRYPTION {
            return Err(SigningKeyError::new(format!(
                "expected an RSA key, found algorithm {}",
                spki.algorithm.oid
            )));
        }
        let pkcs1 = spki
            .subject_public_key
            .as_bytes()
            .ok_or_else(|| SigningKeyError::new("public key: bit string not byte aligned"))?
            .to_vec();
        Ok(Self { pkcs1 })
    }

    /// Whether `signature` is a valid SHA256withRSA signature of `message`.
    pub fn verify_sha256(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&RSA_PKCS1_2048_8192_SHA256, &self.pkcs1)
            .verify(message, signature)
            .is_ok()
    }
}

fn is_base64_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=' | b'\n' | b'\r' | b' ')
}

/// Decodes base64 (standard alphabet) key material.
pub(crate) fn base64_key(what: &str, s: &str) -> Result<Vec<u8>, SigningKeyError> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|_| SigningKeyError::new(format!("{what}: not base64")))
}
