//! Bad flags and values, read as the process reads them: each gives the
//! message the gateway prints (after `idempotency-gateway: `) before it
//! exits 2. A few of them are run as a process too (`tests/forward`).

use crate::settings::cli::{Args, Parsed};
use crate::settings::config::{self, Settings};

/// The settings of these flags, or the message for exit status 2.
fn settings(argv: &[&str]) -> Result<Settings, String> {
    let all = std::iter::once("idempotency-gateway").chain(argv.iter().copied());
    match Args::from_argv(all)? {
        Parsed::Run(args) => config::settings(*args),
        Parsed::Printed => panic!("{argv:?} printed help"),
    }
}

/// The message that refuses `argv`.
fn refused(argv: &[&str]) -> String {
    match settings(argv) {
        Ok(_) => panic!("{argv:?} was taken"),
        Err(e) => e,
    }
}

/// The flags the cases of [`bad_values_of_a_flag_name_it`] are added to.
const BASE: [&str; 4] = [
    "--listen",
    "127.0.0.1:0",
    "--upstream",
    "http://127.0.0.1:1",
];

const ADDR: &str = "expected IP:PORT, e.g. 127.0.0.1:8080 or [::1]:8080";
const UNIT: &str = "; expected a number and a unit: 500ms, 30s, 5m, 25h, 2d";

#[test]
fn the_listener_and_the_upstream_are_required_and_checked() {
    let cases: &[(&[&str], &str)] = &[
        (&[], "`--listen ADDR` is required"),
        (&["--listen", "127.0.0.1:0"], "`--upstream URL` is required"),
        (
            &["--upstream", "http://127.0.0.1:1"],
            "`--listen ADDR` is required",
        ),
        (
            &["--listen", "localhost", "--upstream", "http://127.0.0.1:1"],
            &format!("invalid value 'localhost' for '--listen <ADDR>': {ADDR}"),
        ),
        (
            &["--listen", "127.0.0.1:0", "--upstream", "ftp://x"],
            "invalid value 'ftp://x' for '--upstream <URL>': expected http://HOST:PORT[/BASE] \
             or https://HOST:PORT[/BASE]",
        ),
        // https upstreams work; one with a query does not.
        (
            &[
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "https://x/base?q=1",
            ],
            "invalid value 'https://x/base?q=1' for '--upstream <URL>': the upstream URL \
             cannot have a query",
        ),
    ];
    for (argv, want) in cases {
        assert_eq!(refused(argv), *want, "{argv:?}");
    }
    assert!(settings(&["--listen", "127.0.0.1:0", "--upstream", "https://x/base"]).is_ok());
}

#[test]
fn bad_values_of_a_flag_name_it() {
    let cases: &[(&[&str], &str)] = &[
        (&["--frobnicate"], "unknown flag `--frobnicate`"),
        (&["stray"], "unexpected argument `stray`"),
        (&["--window"], "`--window` needs a value"),
        (
            &["--lease", "0s"],
            "invalid value '0s' for '--lease <DUR>': must be more than 0",
        ),
        (
            &["--max-body", "64KB"],
            "invalid value '64KB' for '--max-body <SIZE>': expected bytes or a whole number \
             with B, KiB, MiB or GiB (e.g. 64KiB)",
        ),
        (
            &["--route", "/x"],
            "invalid value '/x' for '--route <PREFIX=PRESET>': expected PREFIX=PRESET, e.g. \
             /notify/wechat=wechatpay-v3",
        ),
        (
            &["--route", "x=stripe"],
            "invalid value 'x=stripe' for '--route <PREFIX=PRESET>': the prefix must start \
             with `/`",
        ),
        (
            &["--route", "/x=bitcoin"],
            "invalid value '/x=bitcoin' for '--route <PREFIX=PRESET>': unknown preset \
             `bitcoin`; expected auto or one of [\"wechatpay-v3\", \"wechatpay-v2\", \
             \"alipay\", \"stripe\", \"paypal\", \"adyen\", \"standard-webhooks\", \
             \"idempotency-key\", \"client-token\"]",
        ),
        (
            &["--route", "/x=stripe", "--route", "/x/=alipay"],
            "bad value `/x/` for `--route`: the prefix `/x` is routed twice",
        ),
        (
            &["--store", "mongodb://x:1"],
            "invalid value 'mongodb://x:1' for '--store <STORE>': expected memory, \
             redis://HOST:PORT, redis+cluster://HOST:PORT[,HOST:PORT...], postgres://…, \
             mysql://… or sqlite:PATH",
        ),
        (
            &["--store", "redis+cluster://a:1,b"],
            "invalid value 'redis+cluster://a:1,b' for '--store <STORE>': `b`: expected \
             HOST:PORT",
        ),
        (
            &["--on-store-error", "maybe"],
            "invalid value 'maybe' for '--on-store-error <POLICY>': expected `closed` or \
             `open`",
        ),
        (
            &["--principal-header", "bad header"],
            "invalid value 'bad header' for '--principal-header <NAME>': not a header name",
        ),
        (
            &["--metrics-listen", "9100"],
            &format!("invalid value '9100' for '--admin-listen <ADDR>': {ADDR}"),
        ),
    ];
    for (extra, want) in cases {
        let argv: Vec<&str> = BASE.iter().chain(*extra).copied().collect();
        assert_eq!(refused(&argv), *want, "{extra:?}");
    }
    // A duration's message is the parser's reason, then the units it takes.
    for (flag, value) in [("--window", "25x"), ("--wait", "soon")] {
        let argv: Vec<&str> = BASE.iter().copied().chain([flag, value]).collect();
        let e = refused(&argv);
        let head = format!("invalid value '{value}' for '{flag} <DUR>': ");
        assert!(e.starts_with(&head) && e.ends_with(UNIT), "{e}");
    }
}

/// A flag wins over the file's value, but a bad value in the file is
/// refused at its line all the same; the file's value counts without the flag.
#[test]
fn a_flag_over_the_file_and_the_file_checked_anyway() {
    let file = std::env::temp_dir().join(format!("gateway-pick-{}.toml", std::process::id()));
    let path = file.to_str().unwrap();
    std::fs::write(&file, "upstream = \"http://127.0.0.1:1\"\nworkers = 0\n").unwrap();
    let bad = refused(&[
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--config",
        path,
    ]);
    std::fs::write(&file, "upstream = \"http://127.0.0.1:1\"\nworkers = 3\n").unwrap();
    let flag = settings(&[
        "--listen",
        "127.0.0.1:0",
        "--workers",
        "2",
        "--config",
        path,
    ]);
    let from_file = settings(&["--listen", "127.0.0.1:0", "--config", path]);
    std::fs::remove_file(&file).unwrap();
    assert_eq!(
        bad,
        format!("{path}:2: `workers`: expected a number of serving threads from 1 to 1024")
    );
    assert_eq!(flag.unwrap().serve.workers, 2);
    assert_eq!(from_file.unwrap().serve.workers, 3);
}
