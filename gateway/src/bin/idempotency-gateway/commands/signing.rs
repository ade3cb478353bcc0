//! What `send` signs with: an RSA private key (WeChat Pay v3, Alipay,
//! PayPal) or a secret (the HMAC channels), with `ring`, the crate the
//! verifiers check with; random ids and nonces from `ring`'s system random.

use base64::Engine as _;
use ring::rand::{SecureRandom, SystemRandom};
use ring::{hmac, signature};
use std::path::Path;

/// `n` random bytes as lower-case hex (`2n` characters).
pub(crate) fn random_hex(n: usize) -> String {
    let mut bytes = vec![0; n];
    // The system's random source does not fail on Linux once booted.
    let _ = SystemRandom::new().fill(&mut bytes);
    hex(&bytes)
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Standard base64, padded.
pub(crate) fn base64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `ring`'s system random as the `rand_core` source the `rsa` crate's key
/// generation takes.
pub(crate) struct RingRandom(SystemRandom);

impl Default for RingRandom {
    fn default() -> Self {
        Self(SystemRandom::new())
    }
}

impl rsa::rand_core::RngCore for RingRandom {
    fn next_u32(&mut self) -> u32 {
        let mut b = [0; 4];
        self.fill_bytes(&mut b);
        u32::from_le_bytes(b)
    }

    fn next_u64(&mut self) -> u64 {
        let mut b = [0; 8];
        self.fill_bytes(&mut b);
        u64::from_le_bytes(b)
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        // The system's random source does not fail on Linux once booted.
        let _ = self.0.fill(dest);
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rsa::rand_core::Error> {
        self.0
            .fill(dest)
            .map_err(|_| rsa::rand_core::Error::new("the system random source failed"))
    }
}

impl rsa::rand_core::CryptoRng for RingRandom {}

/// An RSA private key (PKCS#8 `PRIVATE KEY` or PKCS#1 `RSA PRIVATE KEY`
/// PEM, as the channels' consoles and `test-keys` write them).
pub(crate) struct RsaSigner(signature::RsaKeyPair);

impl RsaSigner {
    /// Reads the key at `path`.
    pub(crate) fn read(path: &Path) -> Result<Self, String> {
        use rsa::pkcs1::DecodeRsaPrivateKey;
        use rsa::pkcs8::{DecodePrivateKey, EncodePrivateKey};
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the private key {}: {e}", path.display()))?;
        let key = rsa::RsaPrivateKey::from_pkcs8_pem(&text)
            .or_else(|_| rsa::RsaPrivateKey::from_pkcs1_pem(&text))
            .map_err(|_| {
                format!(
                    "{}: not an RSA private key (PEM `PRIVATE KEY` or `RSA PRIVATE KEY`; \
                     `idempotency-gateway test-keys DIR` writes one)",
                    path.display()
                )
            })?;
        let der = key
            .to_pkcs8_der()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        signature::RsaKeyPair::from_pkcs8(der.as_bytes())
            .map(Self)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// RSA PKCS#1 v1.5 SHA-256 of `message`, base64.
    pub(crate) fn sign_base64(&self, message: &[u8]) -> Result<String, String> {
        let mut sig = vec![0; self.0.public().modulus_len()];
        self.0
            .sign(
                &signature::RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                message,
                &mut sig,
            )
            .map_err(|_| "cannot sign with the RSA key".to_owned())?;
        Ok(base64(&sig))
    }

    /// A key id derived from the public key (WeChat Pay's `Wechatpay-Serial`
    /// of a test key): `test-keys` prints it in the `verify` line, `send`
    /// sends it.
    pub(crate) fn serial(&self) -> String {
        let digest = ring::digest::digest(&ring::digest::SHA256, self.0.public().as_ref());
        format!("TEST{}", hex(&digest.as_ref()[..16]).to_uppercase())
    }
}

/// The HMAC of `message` under `key`.
pub(crate) fn hmac(algorithm: hmac::Algorithm, key: &[u8], message: &[u8]) -> Vec<u8> {
    hmac::sign(&hmac::Key::new(algorithm, key), message)
        .as_ref()
        .to_vec()
}

/// A secret file's text, as the gateway's `verify` tables read one: its
/// contents, trimmed.
pub(crate) fn read_secret(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the secret {}: {e}", path.display()))?;
    let text = text.trim();
    if text.is_empty() {
        return Err(format!("the secret {} is empty", path.display()));
    }
    Ok(text.to_owned())
}
