//! The command line: flags, their defaults and their checks.

use tokio::sync::Semaphore;

/// The route the notifications are posted to.
pub(crate) const NOTIFY_PATH: &str = "/notify/wechatpay/v3";
/// The client API route of `--scenario double-submit`.
pub(crate) const ORDERS_PATH: &str = "/orders";

pub(crate) const USAGE: &str = "\
usage: retry_storm [--transactions N] [--duplicates K] [--concurrency C]
                   [--handler-ms MS] [--failure-rate F]
                   [--baseline compare|none|dedup|axum-idempotent|axum-idempotent-nocookie]
                   [--store memory|redis://HOST:PORT|redis+cluster://HOST:PORT[,HOST:PORT...]
                            |postgres://…|mysql://…|sqlite:PATH|tiered:redis://HOST:PORT+postgres://…]
                   [--instances N] [--scenario burst|double-submit|outage] [--limit N]
                   [--repeat] [--json]

With no --baseline, runs the naive handler (none) and the guarded stack (dedup)
on the same storm and prints them side by side; with --json alone, runs dedup.
--scenario outage: the backlog after an outage (default 600 notifications x 3
copies) against a fragile upstream, through the gateway with no limit and with
--limit (default 20) upstream calls at once; --limit auto: the route's adaptive
limit (max_in_flight = \"auto\", starting at 5) instead. With --store
redis://HOST:PORT, one more row: --instances gateways (default 3) on one Redis
Streams queue, the limit and the breaker shared by all of them.
--repeat: after the storm, every notification once more (each a replay of its
completed record), measured apart.";

/// One system under the storm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Baseline {
    /// The handler alone.
    None,
    /// The handler behind `IdempotencyLayer::wechatpay_v3()`.
    Dedup,
    /// The handler in an axum `Router` behind axum-idempotent 0.6, the client
    /// sending one session cookie per transaction.
    AxumIdempotent,
    /// The same, the client sending no cookie (as a payment channel does).
    AxumIdempotentNoCookie,
}

impl Baseline {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Baseline::None => "none",
            Baseline::Dedup => "dedup",
            Baseline::AxumIdempotent => "axum-idempotent",
            Baseline::AxumIdempotentNoCookie => "axum-idempotent-nocookie",
        }
    }

    pub(crate) fn is_axum_idempotent(self) -> bool {
        matches!(
            self,
            Baseline::AxumIdempotent | Baseline::AxumIdempotentNoCookie
        )
    }
}

/// What the client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    /// A channel's notification storm: copies at the same instant, each
    /// re-encrypted (WeChat Pay v3 preset).
    Burst,
    /// A client double-clicking "submit order": copies of one request
    /// spread over 100 ms, same bytes, `Idempotency-Key` header
    /// (idempotency-key preset, route `/orders`).
    DoubleSubmit,
    /// The storm after an outage: a backlog of distinct notifications at
    /// once against a fragile upstream, through the library's `Gateway`.
    Outage,
}

impl Scenario {
    /// The route the copies are posted to.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Scenario::Burst => NOTIFY_PATH,
            Scenario::DoubleSubmit => ORDERS_PATH,
            Scenario::Outage => crate::outage::PATH,
        }
    }

    /// One line for people: what the storm is.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Scenario::Burst => "WeChat Pay v3 notifications, copies sent at the same instant",
            Scenario::DoubleSubmit => {
                "order submissions with Idempotency-Key, copies spread over 100 ms"
            }
            Scenario::Outage => "the backlog after an outage, against a fragile upstream",
        }
    }
}

/// Where the dedup records live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreArg {
    Memory,
    Redis(String),
    Cluster(Vec<String>),
    /// `postgres://…`, `mysql://…`, `sqlite:PATH`.
    Sql(String),
    /// `tiered:REDIS+SQL`: Redis in front of a SQL database.
    Tiered {
        redis: String,
        sql: String,
    },
}

/// The schemes of a SQL database's URL.
const SQL_SCHEMES: [&str; 5] = [
    "postgres://",
    "postgresql://",
    "mysql://",
    "mariadb://",
    "sqlite:",
];

impl StoreArg {
    /// What the store is, for people.
    pub(crate) fn describe(&self) -> &'static str {
        match self {
            StoreArg::Memory => "memory",
            StoreArg::Redis(_) => "Redis",
            StoreArg::Cluster(_) => "Redis Cluster",
            StoreArg::Sql(url) if url.starts_with("sqlite:") => "SQLite",
            StoreArg::Sql(url) if url.starts_with("postgres") => "PostgreSQL",
            StoreArg::Sql(_) => "MySQL",
            StoreArg::Tiered { .. } => "Redis in front of SQL",
        }
    }

    fn parse(value: &str) -> Result<Self, String> {
        if value == "memory" {
            return Ok(Self::Memory);
        }
        if let Some(both) = value.strip_prefix("tiered:") {
            // The SQL URL starts at the first `+` followed by a SQL scheme.
            let split = both.match_indices('+').map(|(at, _)| at).find(|&at| {
                SQL_SCHEMES
                    .iter()
                    .any(|scheme| both[at + 1..].starts_with(scheme))
            });
            if let Some(at) = split {
                let (redis, sql) = (&both[..at], &both[at + 1..]);
                if let (Ok(Self::Redis(redis)), Ok(Self::Sql(sql))) =
                    (Self::parse(redis), Self::parse(sql))
                {
                    return Ok(Self::Tiered { redis, sql });
                }
            }
            return Err(format!(
                "--store: `{value}` is not `tiered:redis://HOST:PORT+postgres://…` (or +mysql://…, +sqlite:PATH)"
            ));
        }
        if SQL_SCHEMES
            .iter()
            .any(|scheme| value.len() > scheme.len() && value.starts_with(scheme))
        {
            if value == "sqlite::memory:" {
                return Err("--store: sqlite:PATH needs a file".into());
            }
            return Ok(Self::Sql(value.to_owned()));
        }
        if value.starts_with("redis://") || value.starts_with("rediss://") {
            return Ok(Self::Redis(value.to_owned()));
        }
        if let Some(nodes) = value.strip_prefix("redis+cluster://") {
            let nodes: Vec<String> = nodes
                .split(',')
                .filter(|n| !n.is_empty())
                .map(|n| format!("redis://{n}"))
                .collect();
            if !nodes.is_empty() {
                return Ok(Self::Cluster(nodes));
            }
        }
        Err(format!(
            "--store: `{value}` is not `memory`, `redis://HOST:PORT`, `redis+cluster://HOST:PORT[,HOST:PORT...]`, `postgres://…`, `mysql://…`, `sqlite:PATH` or `tiered:redis://HOST:PORT+postgres://…`"
        ))
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) transactions: usize,
    pub(crate) duplicates: usize,
    pub(crate) concurrency: usize,
    pub(crate) handler_ms: u64,
    pub(crate) failure_rate: f64,
    /// The system to run alone; unused when `compare` is set.
    pub(crate) baseline: Baseline,
    /// Run `Baseline::None` and then `Baseline::Dedup` on the same storm.
    pub(crate) compare: bool,
    pub(crate) store: StoreArg,
    pub(crate) instances: usize,
    pub(crate) scenario: Scenario,
    pub(crate) json: bool,
    /// The outage scenario's cap on upstream calls in its shed mode.
    pub(crate) limit: usize,
    /// After the storm, every notification once more (replays), measured apart.
    pub(crate) repeat: bool,
    /// `--limit auto`: the shed mode's cap is the route's adaptive limit.
    pub(crate) limit_auto: bool,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            transactions: 2000,
            duplicates: 7,
            concurrency: 64,
            handler_ms: 5,
            failure_rate: 0.0,
            baseline: Baseline::Dedup,
            compare: true,
            store: StoreArg::Memory,
            instances: 1,
            scenario: Scenario::Burst,
            json: false,
            limit: 20,
            repeat: false,
            limit_auto: false,
        }
    }
}

/// What the command line asked for.
pub(crate) enum Parsed {
    Run(Args),
    Help,
}

pub(crate) fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Parsed, String> {
    let mut args = Args::default();
    let mut baseline_given = false;
    let (mut transactions_given, mut duplicates_given) = (false, false);
    let mut instances_given = false;
    while let Some(arg) = argv.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        if flag == "--help" || flag == "-h" {
            return Ok(Parsed::Help);
        }
        if flag == "--json" || flag == "--repeat" {
            if inline.is_some() {
                return Err(format!("{flag} takes no value"));
            }
            if flag == "--json" {
                args.json = true;
            } else {
                args.repeat = true;
            }
            continue;
        }
        let known = [
            "--transactions",
            "--duplicates",
            "--concurrency",
            "--handler-ms",
            "--failure-rate",
            "--baseline",
            "--store",
            "--instances",
            "--scenario",
            "--limit",
        ];
        if !known.contains(&flag.as_str()) {
            return Err(format!("unknown flag `{flag}`"));
        }
        let value = match inline {
            Some(value) => value,
            None => argv.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        match flag.as_str() {
            "--transactions" => {
                transactions_given = true;
                args.transactions = positive(&flag, &value)?;
            }
            "--duplicates" => {
                duplicates_given = true;
                args.duplicates = positive(&flag, &value)?;
            }
            "--limit" if value == "auto" => args.limit_auto = true,
            "--limit" => args.limit = positive(&flag, &value)?,
            "--concurrency" => {
                args.concurrency = positive(&flag, &value)?;
                if args.concurrency > Semaphore::MAX_PERMITS {
                    return Err(format!("{flag}: {value} is too large"));
                }
            }
            "--handler-ms" => {
                args.handler_ms = value.parse().map_err(|_| {
                    format!("{flag}: `{value}` is not a whole number of milliseconds")
                })?;
            }
            "--failure-rate" => {
                let rate: f64 = value
                    .parse()
                    .map_err(|_| format!("{flag}: `{value}` is not a number"))?;
                if !(0.0..=1.0).contains(&rate) {
                    return Err(format!("{flag}: {value} is not in [0, 1]"));
                }
                args.failure_rate = rate;
            }
            "--baseline" => {
                baseline_given = true;
                args.compare = value == "compare";
                args.baseline = match value.as_str() {
                    "compare" => Baseline::Dedup,
                    "none" => Baseline::None,
                    "dedup" => Baseline::Dedup,
                    "axum-idempotent" => Baseline::AxumIdempotent,
                    "axum-idempotent-nocookie" => Baseline::AxumIdempotentNoCookie,
                    _ => {
                        return Err(format!(
                            "{flag}: `{value}` is not `compare`, `none`, `dedup`, `axum-idempotent` or `axum-idempotent-nocookie`"
                        ))
                    }
                }
            }
            "--store" => args.store = StoreArg::parse(&value)?,
            "--instances" => {
                instances_given = true;
                args.instances = positive(&flag, &value)?;
            }
            "--scenario" => {
                args.scenario = match value.as_str() {
                    "burst" => Scenario::Burst,
                    "double-submit" => Scenario::DoubleSubmit,
                    "outage" => Scenario::Outage,
                    _ => {
                        return Err(format!(
                            "{flag}: `{value}` is not `burst`, `double-submit` or `outage`"
                        ))
                    }
                }
            }
            _ => unreachable!("checked against `known` above"),
        }
    }
    if args.repeat && args.scenario == Scenario::Outage {
        return Err("--repeat: the outage scenario has its own two runs".into());
    }
    if args.scenario == Scenario::Outage {
        // The post-mortem's backlog: 600 notifications, 3 copies each.
        if !transactions_given {
            args.transactions = 600;
        }
        if !duplicates_given {
            args.duplicates = 3;
        }
        // The shared row (with --store redis://): three gateways.
        if !instances_given {
            args.instances = 3;
        }
        if !matches!(args.store, StoreArg::Memory | StoreArg::Redis(_)) {
            return Err(
                "--store: the outage scenario's shared row runs on `redis://HOST:PORT`".into(),
            );
        }
    }
    // Scripts that read the JSON line measure one system, as before the
    // comparison became the default.
    if !baseline_given && args.json {
        args.compare = false;
    }
    if !args.compare && args.baseline.is_axum_idempotent() && args.store != StoreArg::Memory {
        return Err(format!(
            "--store: `{}` keeps its sessions in memory; --store applies to `dedup` only",
            args.baseline.name()
        ));
    }
    Ok(Parsed::Run(args))
}

fn positive(flag: &str, value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag}: `{value}` is not a positive whole number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(value: &str) -> Result<StoreArg, String> {
        let argv = ["--store", value].map(String::from).into_iter();
        match parse_args(argv)? {
            Parsed::Run(args) => Ok(args.store),
            Parsed::Help => unreachable!(),
        }
    }

    #[test]
    fn stores_parse() {
        assert_eq!(store("memory"), Ok(StoreArg::Memory));
        let pg = "postgres://me@127.0.0.1:5432/shop";
        assert_eq!(store(pg), Ok(StoreArg::Sql(pg.into())));
        assert_eq!(
            store("sqlite:/tmp/s.db"),
            Ok(StoreArg::Sql("sqlite:/tmp/s.db".into()))
        );
        assert_eq!(
            store(&format!("tiered:redis://:p+w@h:1+{pg}")),
            Ok(StoreArg::Tiered {
                redis: "redis://:p+w@h:1".into(),
                sql: pg.into(),
            })
        );
        for bad in [
            "tiered:redis://h:1",
            "tiered:postgres://h/db+redis://h:1",
            "tiered:redis://h:1+redis://h:2",
            "sqlite::memory:",
            "postgres://",
            "http://h",
        ] {
            assert!(store(bad).is_err(), "{bad}");
        }
    }
}
