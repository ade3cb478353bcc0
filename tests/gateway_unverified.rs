//! The gateway example warns once at start per channel route that does not
//! verify the sender (build it first: `cargo build --all-features --example
//! gateway`).

mod common;
mod gateway_support;

use gateway_support::{temp_path, Gateway};
use std::time::{Duration, Instant};

#[test]
fn the_gateway_warns_once_per_unverified_channel_route() {
    let dir = temp_path("unverified");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        "[[route]]\nprefix = \"/notify/wechat\"\npreset = \"wechatpay-v3\"\n\
         [[route]]\nprefix = \"/notify/stripe\"\npreset = \"stripe\"\n\
         verify = { secrets = [\"whsec_test_secret\"] }\n\
         [[route]]\nprefix = \"/api\"\npreset = \"idempotency-key\"\n\
         [[route]]\nprefix = \"/\"\npreset = \"auto\"\n",
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    // Two serving threads, each with its own routes: still one warning per route.
    let gw = Gateway::start(
        "http://127.0.0.1:9",
        &["--config", &config, "--workers", "2"],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.log().contains("gateway started") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = gw.log();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("without verification"))
        .collect();
    assert_eq!(warnings.len(), 2, "{log}");
    assert_eq!(
        warnings
            .iter()
            .filter(|l| l.contains("route=/notify/wechat ") && l.contains("wechatpay-v3"))
            .count(),
        1,
        "{log}"
    );
    assert_eq!(
        warnings
            .iter()
            .filter(|l| l.contains("route=/ ") && l.contains("auto"))
            .count(),
        1,
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
