//! The command line: subcommands, their help, and the parsers that check
//! every value before anything starts.

use clap::{Args, Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;
use vgpu_node_contract::region::MAX_DEVICES;
use vgpu_node_contract::size::{parse_percent, parse_size};

const EXAMPLES: &str = "\
Examples:
  vgpu run --memory 8g --cores 30 -- python train.py
  vgpu run --name team --memory 4g --cores 50 -- ./worker   # run it again: same cap, shared
  vgpu ls
  vgpu inspect team --json
  vgpu set team --cores 20
  vgpu top                      # live, every second; s/n/m/u/t sort, q quits
  vgpu top --once --sort util   # one plain table, for scripts
  vgpu demo                     # a cap and a share holding, on this machine's GPU or a simulated one
  vgpu doctor                   # what vgpu sees here: driver, GPUs, DRA slice, shim, monitor (--json)
  vgpu cordon gpu-node-1 0      # on Kubernetes: GPU 0 of a node gets no new vGPU (uncordon: back)
  vgpu resize my-pod --cores 20 # on Kubernetes: a running pod's share, within its request

Regions live in --root: /usr/local/vgpu/containers for root (the directory
the node monitor watches), else $XDG_RUNTIME_DIR/vgpu, else /tmp/vgpu-<uid>.";

/// Share an NVIDIA GPU between programs on one machine, without Kubernetes:
/// each run gets a memory cap and a compute share that the vgpu shim
/// (libvgpu.so) enforces, kept in a region file that `ls`, `inspect` and
/// the node monitor read.
#[derive(Debug, Parser)]
#[command(name = "vgpu", version, after_help = EXAMPLES)]
pub struct Cli {
    /// Directory holding one directory per region [default: see below]
    #[arg(long, global = true, env = "VGPU_ROOT", value_name = "DIR")]
    pub root: Option<PathBuf>,

    /// Level of vgpu's own log lines on stderr (error, warn, info, debug, trace)
    #[arg(long, global = true, default_value = "warn", value_name = "LEVEL")]
    pub log_level: tracing::Level,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command under the shim with a memory cap and a compute share
    Run(RunArgs),
    /// List the regions you can see, with their limits and use
    Ls(LsArgs),
    /// Show one region: limits and use per GPU, and its processes
    Inspect(InspectArgs),
    /// Change a local region's limits while it runs
    Set(SetArgs),
    /// Every region's GPUs, live: memory, share, utilization, throttling
    Top(TopArgs),
    /// Show a memory cap and a compute share holding, on a real or simulated GPU
    Demo(DemoArgs),
    /// Check what vgpu sees here: driver, GPUs, the DRA slice, the shim, the monitor
    Doctor(DoctorArgs),
    /// Take GPUs of a Kubernetes node out of service for new vGPUs (running pods stay)
    Cordon(CordonArgs),
    /// Put cordoned GPUs of a Kubernetes node back in service
    Uncordon(UncordonArgs),
    /// Change a running Kubernetes pod's compute share or memory cap, within its request
    Resize(ResizeArgs),
    /// `vgpu doctor`'s CUDA program, run under the shim (not for users)
    #[command(name = "doctor-probe", hide = true)]
    DoctorProbe,
}

const CORDON_EXAMPLES: &str = "\
Examples:
  vgpu cordon gpu-node-1 0                 # GPU 0 (nvidia-smi's index) gets no new vGPU
  vgpu cordon gpu-node-1 GPU-5f1c...       # by UUID
  vgpu cordon gpu-node-1                   # show the node's GPUs and which are cordoned
  vgpu uncordon gpu-node-1 0
  vgpu uncordon gpu-node-1 --all

The node's annotation vgpu.io/cordoned-gpus lists the cordoned GPUs' UUIDs
(HAMi's hami.io/device-cordon is read too, and uncordon clears a GPU from
both). The scheduler extender places no new vGPU on them and the DRA driver
takes them out of its ResourceSlice; pods already on them keep running.
GPUs are named by index or UUID as the node's device plugin (its
vgpu.io/node-gpus annotation) or DRA driver (its ResourceSlice) lists them.

The API server: --kubeconfig, else $KUBECONFIG or ~/.kube/config, else the
pod's service account. Needs get and patch on nodes (and list on
resourceslices for DRA nodes).

Exit status: 0 done (or nothing to change), 1 refused or failed (one line on
stderr), 2 for an invalid command line.";

/// Single GPUs of a Kubernetes node out of service.
#[derive(Debug, Args)]
#[command(after_help = CORDON_EXAMPLES)]
pub struct CordonArgs {
    /// The node's name
    pub node: String,

    /// GPUs to cordon, by index or UUID; none: show the node's GPUs
    #[arg(value_name = "GPU")]
    pub gpus: Vec<String>,

    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

/// Cordoned GPUs of a Kubernetes node back in service.
#[derive(Debug, Args)]
#[command(after_help = CORDON_EXAMPLES)]
pub struct UncordonArgs {
    /// The node's name
    pub node: String,

    /// GPUs to put back, by index or UUID
    #[arg(
        value_name = "GPU",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    pub gpus: Vec<String>,

    /// Every cordoned GPU of the node
    #[arg(long)]
    pub all: bool,

    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

const RESIZE_EXAMPLES: &str = "\
Examples:
  vgpu resize inference-0 --cores 20                 # each of its vGPUs down to 20 %
  vgpu resize inference-0 -n serving --memory 4g --cores 50
  vgpu resize inference-0 --cores 70                 # back up, if its GPU has the room

The request goes on the pod (annotation vgpu.io/resize:
cores=20,memory=4096Mi,asked=<unix ms>, the time making each request new)
and vgpu-scheduler alone answers it, in vgpu.io/resize-status: applied when
the pod's resources ask for at least as much and its GPUs have the room,
else refused with the reason. The node monitor then writes the new limits
into the containers' regions and the shim applies them at once: a lower
share within a throttling period, a lower cap refuses new allocations and
frees nothing the container holds. Every vGPU container of the pod and each
of its GPUs get the same new figures.

The API server: --kubeconfig, else $KUBECONFIG or ~/.kube/config, else the
pod's service account; needs get and patch on pods.

Exit status: 0 applied, 1 refused or no answer (one line on stderr), 2 for
an invalid command line.";

/// A running pod's share or cap changed.
#[derive(Debug, Args)]
#[command(after_help = RESIZE_EXAMPLES)]
pub struct ResizeArgs {
    /// The pod's name
    pub pod: String,

    /// The pod's namespace [default: the kubeconfig's]
    #[arg(short, long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,

    /// New compute share per vGPU in percent, 1-100
    #[arg(long, value_parser = cores, value_name = "PERCENT")]
    pub cores: Option<u32>,

    /// New memory cap per vGPU: a size with a unit (4g, 4096Mi), whole MiB
    #[arg(long, value_parser = memory_cap, value_name = "SIZE")]
    pub memory: Option<u64>,

    /// How long to wait for vgpu-scheduler's answer
    #[arg(long = "timeout", default_value_t = 30, value_name = "SECONDS",
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_seconds: u64,

    /// kubeconfig file [default: $KUBECONFIG, ~/.kube/config, or in-cluster]
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
}

const RUN_EXAMPLES: &str = "\
Examples:
  vgpu run --memory 8g --cores 30 -- python train.py
  vgpu run --memory 16g --swap 16g --devices 0,1 -- ./big-model
  vgpu run --name team --memory 4g --cores 50 -- ./worker-a &
  vgpu run --name team --memory 4g --cores 50 -- ./worker-b   # shares worker-a's 4 GiB and 50 %

Runs with one --name share one region: one cap and one share for all their
processes, like the processes of one container. A run that names other
limits than the region's is refused while anything runs in it; an idle
region takes the new limits.

The shim: --library, else $VGPU_LIBRARY, else libvgpu.so next to the vgpu
binary (a cargo target directory), else /usr/local/vgpu/libvgpu.so (where
the Helm chart installs it on nodes).

Exit status: the command's own; 128+N if it was killed by signal N; 127 if
it was not found, 126 if it could not be executed; 2 for an invalid value
(one line on stderr); 125 if vgpu could not set up the run. vgpu writes
nothing on stdout. SIGTERM and SIGHUP are passed on to the command; SIGINT
and SIGQUIT reach it from the terminal, and vgpu waits for it.";

/// Run a command under the shim with a memory cap and a compute share.
#[derive(Debug, Args)]
#[command(after_help = RUN_EXAMPLES)]
pub struct RunArgs {
    /// Device memory cap per GPU: bytes or k/m/g/t, K/M/G/T, Ki/Mi/Gi/Ti (all binary)
    #[arg(long, value_parser = memory_cap, value_name = "SIZE")]
    pub memory: Option<u64>,

    /// Compute share per GPU in percent, 1-100 (100: the whole GPU)
    #[arg(long, value_parser = cores, value_name = "PERCENT")]
    pub cores: Option<u32>,

    /// Share in percent the run may use while the GPU is otherwise idle
    /// (at least --cores); only a node monitor lends it
    #[arg(long, value_parser = cores, value_name = "PERCENT", requires = "cores")]
    pub burst: Option<u32>,

    /// Host memory per GPU that allocations beyond the memory cap may use
    /// (turns on CUDA_OVERSUBSCRIBE)
    #[arg(long, value_parser = memory_cap, value_name = "SIZE")]
    pub swap: Option<u64>,

    /// GPUs the command sees, by index in PCI order as nvidia-smi lists them
    /// (CUDA_VISIBLE_DEVICES); all when not given
    #[arg(long, value_parser = device_list, value_name = "I,J,...")]
    pub devices: Option<DeviceList>,

    /// Region to run in: letters, digits, '-' and '.'; runs naming the same
    /// region share its limits [default: one region per run, run-<pid>]
    #[arg(long, value_parser = region_name, value_name = "NAME")]
    pub name: Option<String>,

    /// The shim to preload
    #[arg(long, env = "VGPU_LIBRARY", value_name = "PATH")]
    pub library: Option<PathBuf>,

    /// The command and its arguments
    #[arg(
        required = true,
        num_args = 1..,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<OsString>,
}

/// List the regions you can see, with their limits and use.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  vgpu ls\n  vgpu ls --json | jq '.[].name'")]
pub struct LsArgs {
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

/// Show one region: limits and use per GPU, and its processes.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  vgpu inspect team\n  vgpu inspect /usr/local/vgpu/containers/<podUID>_<container> --json"
)]
pub struct InspectArgs {
    /// A region's name (as `vgpu run --name` gave it, or its directory's
    /// name), or the path of its directory or region file
    #[arg(value_name = "NAME|PATH")]
    pub target: String,

    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
}

/// Every region's GPUs, measured over an interval: memory used against the
/// cap, swap, configured and effective share, achieved utilization, time
/// throttled, launches, out-of-memory events.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vgpu top
  vgpu top --interval-ms 250 --sort util
  vgpu top --once --interval-ms 5000 --sort util > top.txt

Without --once, a live table in the terminal, read again every
--interval-ms. Keys: s sorts by the next column, n/m/u/t by name, memory,
utilization or throttled time (the sorted column's title is marked *);
q, Esc or Ctrl-C quit. Regions that appear or vanish do so at the next
refresh. The live view needs a terminal; elsewhere use --once.

--once prints one plain table, measured over --interval-ms, and exits.

UTIL is the device time the shim granted over the interval, as the node
monitor measures a capped container; THROT the time spent waiting for the
share; LAUNCHES the kernel launches in the interval; OOM the allocations
refused since the region was made.")]
pub struct TopArgs {
    /// Print one plain table and exit, instead of the live view
    #[arg(long)]
    pub once: bool,

    /// Milliseconds between readings (the live view's refresh; with --once,
    /// the interval the one table is measured over)
    #[arg(long, default_value_t = 1000, value_name = "MS",
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub interval_ms: u64,

    /// The column rows are sorted by (the live view starts with it)
    #[arg(long, value_enum, default_value_t = crate::top::SortKey::Name)]
    pub sort: crate::top::SortKey,
}

/// Show a memory cap and a compute share holding.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vgpu demo
  vgpu demo --simulated

Runs two small CUDA programs (built with vgpu from testkit/programs) without
and with `vgpu run`, keeping its regions in a temporary directory of its own
(not --root) that it removes afterwards:

  memory   allocates 256 MiB buffers until refused: without vgpu up to the
           device's size, under `vgpu run --memory 4g` up to the 4 GiB cap;
           then NVML, read under the shim, reports the cap as the device's
           size. On a real GPU the device is not filled without vgpu (other
           programs may be using it): NVML's total is shown instead.
  compute  launches 1 ms kernels flat out: without vgpu it takes the whole
           device, under `vgpu run --cores 30` 30 % of its time.

It runs on this machine's NVIDIA GPU (device 0) when the driver is there
(/dev/nvidiactl and a libcuda.so.1 that loads), else on the simulated GPU
(libsimgpu.so, found next to the vgpu binary), and says which. On the
simulated GPU, the device's time is the simulated driver's own record; on a
real one, the kernels completed times their 1 ms over the time they took.
Exit status 1 if the cap did not hold or a step failed.")]
pub struct DemoArgs {
    /// Use the simulated GPU even when a real one is present
    #[arg(long)]
    pub simulated: bool,

    /// The shim to preload (as for `vgpu run`)
    #[arg(long, env = "VGPU_LIBRARY", value_name = "PATH")]
    pub library: Option<PathBuf>,
}

/// Where `vgpu doctor` scrapes the node monitor unless told otherwise.
pub const DEFAULT_MONITOR_URL: &str = "http://127.0.0.1:31992/metrics";

/// Check what vgpu sees on this machine, each finding with what to do when
/// it is wrong.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vgpu doctor
  vgpu doctor --json | jq '.gpus[] | {uuid, memory_total_mib, numa_node}'
  vgpu doctor --monitor http://10.0.0.7:31992/metrics

Each line is marked ok, warn or fail; a warn or fail line is followed by a
hint. Sections:

  Driver    NVML loaded from --nvml-library (the device plugin's default),
            the file the loader found, the driver's version and the CUDA
            driver version it supports.
  GPUs      each GPU as the device plugin publishes it in the node
            inventory, read by the plugin's own code: NVML index, UUID,
            model, memory (MiB), SMs, NUMA node, NVLink island, PCI bus ID,
            and health by the plugin's probe (a GPU that does not answer
            NVML is unhealthy). Memory is unscaled (no
            --device-memory-scaling).
  DRA       the devices the DRA driver (vgpu-dra) would publish in this
            node's ResourceSlice (built by its own code): name, attributes,
            capacities. The node is --node-name, else $NODE_NAME, else the
            host name. Unhealthy GPUs are left out, as the driver does.
  Shim      a CUDA program (this binary, run by `vgpu run` with the shim
            found as `vgpu run` finds it and a 1 GiB cap, in a temporary
            region removed afterwards) loads libcuda.so.1, creates a
            context on GPU 0, and checks that cuMemGetInfo's total is the
            cap, that memory under the cap can be allocated, and that an
            allocation past it is refused with CUDA_ERROR_OUT_OF_MEMORY.
            Progress goes to stderr. Its region is not in the node
            monitor's directory, so a monitor may log the program once as a
            process without the shim; doctor reads the monitor before it.
  Monitor   the node monitor's metrics (GET --monitor): its regions, each
            container's memory used against its cap and its compute share,
            and per GPU its health and any process running without the
            shim. A monitor that cannot be reached at the default address is
            a warning (machines without Kubernetes run none); at an address
            given with --monitor, a failure.

--json prints one JSON document instead: every figure (driver and CUDA
versions; per GPU uuid, name, memory_total_mib, numa_node, pci_bus_id and
the rest; the ResourceSlice as the API server would receive it; the probe's
figures; the monitor's figures) and every finding.

Exit status: 0 when nothing failed (warnings allowed), 1 when a check
failed, 2 for an invalid option.")]
pub struct DoctorArgs {
    /// Print one JSON document instead of text
    #[arg(long)]
    pub json: bool,

    /// The node monitor's metrics URL, plain HTTP [default: http://127.0.0.1:31992/metrics]
    #[arg(long, value_name = "URL", value_parser = monitor_url)]
    pub monitor: Option<MonitorUrl>,

    /// NVML library to load (as the device plugin's --nvml-library)
    #[arg(long, default_value = "libnvidia-ml.so.1", value_name = "PATH")]
    pub nvml_library: PathBuf,

    /// The shim to probe (as for `vgpu run`)
    #[arg(long, env = "VGPU_LIBRARY", value_name = "PATH")]
    pub library: Option<PathBuf>,

    /// The node's name, for the DRA slice's name and pool [default: the host name]
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
}

/// An `http://host[:port][/path]` URL, checked before anything starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MonitorUrl {
    /// As given.
    pub text: String,
    /// `host:port`, for connecting (port 80 when not given).
    pub authority: String,
    /// `host[:port]` as given, for the Host header.
    pub host: String,
    /// The request path, `/metrics` when none is given.
    pub path: String,
}

fn monitor_url(text: &str) -> Result<MonitorUrl, String> {
    let rest = text.strip_prefix("http://").ok_or_else(|| {
        format!("{text:?}: the monitor serves plain HTTP; give http://HOST:PORT/PATH")
    })?;
    let (host, path) = match rest.find('/') {
        Some(at) => (&rest[..at], &rest[at..]),
        None => (rest, ""),
    };
    if host.is_empty() || host.contains(['@', ' ', '?', '#']) {
        return Err(format!("{text:?}: no host in the URL"));
    }
    // A port is what follows the last ':' outside an IPv6 address's brackets.
    let port_part = match host.rfind(']') {
        Some(close) => host[close + 1..].strip_prefix(':'),
        None => host.rsplit_once(':').map(|(_, port)| port),
    };
    let authority = match port_part {
        Some(port) => {
            port.parse::<u16>()
                .map_err(|_| format!("{text:?}: {port:?} is not a port"))?;
            host.to_string()
        }
        None => format!("{host}:80"),
    };
    let path = if path.is_empty() || path == "/" {
        "/metrics".to_string()
    } else {
        path.to_string()
    };
    Ok(MonitorUrl {
        text: text.to_string(),
        authority,
        host: host.to_string(),
        path,
    })
}

impl MonitorUrl {
    /// The default address, [`DEFAULT_MONITOR_URL`].
    pub fn default_url() -> Self {
        Self {
            text: DEFAULT_MONITOR_URL.to_string(),
            authority: "127.0.0.1:31992".to_string(),
            host: "127.0.0.1:31992".to_string(),
            path: "/metrics".to_string(),
        }
    }
}

/// Change a local region's limits while it runs.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  vgpu set team --cores 20
  vgpu set team --memory 4g --cores 60 --burst 90

Only regions made by `vgpu run` can be changed: a Kubernetes container's
limits come from its pod's scheduling decision. A memory cap below what the
region's processes hold now is refused. The new share applies within the
shim's next throttling period (milliseconds).")]
pub struct SetArgs {
    /// A region's name or the path of its directory or region file
    #[arg(value_name = "NAME|PATH")]
    pub target: String,

    /// New device memory cap per GPU (0: none)
    #[arg(long, value_parser = memory_cap, value_name = "SIZE")]
    pub memory: Option<u64>,

    /// New compute share per GPU in percent, 1-100
    #[arg(long, value_parser = cores, value_name = "PERCENT")]
    pub cores: Option<u32>,

    /// New burst share in percent (at least the share)
    #[arg(long, value_parser = cores, value_name = "PERCENT")]
    pub burst: Option<u32>,
}

/// GPU indices, each once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceList(pub Vec<u32>);

fn memory_cap(text: &str) -> Result<u64, String> {
    parse_size(text).map_err(|error| error.to_string())
}

fn cores(text: &str) -> Result<u32, String> {
    match parse_percent(text) {
        Ok(0) => Err("a share of 0 % would never run; give 1 to 100".to_string()),
        Ok(percent) => Ok(percent),
        Err(error) => Err(error.to_string()),
    }
}

fn device_list(text: &str) -> Result<DeviceList, String> {
    let mut devices = Vec::new();
    for item in text.split(',') {
        let index: u32 = item
            .trim()
            .parse()
            .map_err(|_| format!("{item:?} is not a GPU index (0, 1, ...)"))?;
        if index as usize >= MAX_DEVICES {
            return Err(format!("GPU {index}: at most {MAX_DEVICES} GPUs (0-15)"));
        }
        if devices.contains(&index) {
            return Err(format!("GPU {index} is named twice"));
        }
        devices.push(index);
    }
    Ok(DeviceList(devices))
}

/// Longest region name; the directory name adds `local-`.
const MAX_NAME_LEN: usize = 63;

/// A name that makes a safe directory name which the node monitor and the
/// device plugin can never take for a pod's (`<podUID>_<container>`: no `_`).
fn region_name(text: &str) -> Result<String, String> {
    let valid = !text.is_empty()
        && text.len() <= MAX_NAME_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !text.starts_with('.');
    if valid {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?}: a name is 1 to {MAX_NAME_LEN} letters, digits, '-' and '.', not starting with '.'"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_checked() {
        assert_eq!(memory_cap("8g"), Ok(8 << 30));
        assert!(memory_cap("8x").is_err());
        assert_eq!(cores("30"), Ok(30));
        assert!(cores("101").is_err());
        assert!(cores("0").is_err());
        assert_eq!(device_list("1,0"), Ok(DeviceList(vec![1, 0])));
        assert!(device_list("0,0").is_err());
        assert!(device_list("16").is_err());
        assert!(device_list("a").is_err());
        assert!(region_name("team-1.a").is_ok());
        for bad in ["", "a_b", "../x", ".x", "a/b", &"x".repeat(64)] {
            assert!(region_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_command_keeps_its_own_flags() {
        let cli = Cli::try_parse_from(["vgpu", "run", "--cores", "30", "--", "sh", "-c", "x"])
            .expect("parse");
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert_eq!(run.cores, Some(30));
        assert_eq!(run.command, ["sh", "-c", "x"]);
        <Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn monitor_urls_are_checked() {
        let url = monitor_url("http://10.0.0.7:31992").expect("valid");
        assert_eq!(url.authority, "10.0.0.7:31992");
        assert_eq!(url.path, "/metrics");
        let url = monitor_url("http://node-a/vgpu/metrics").expect("valid");
        assert_eq!(url.authority, "node-a:80");
        assert_eq!(url.host, "node-a");
        assert_eq!(url.path, "/vgpu/metrics");
        let url = monitor_url("http://[::1]:31992/metrics").expect("valid");
        assert_eq!(url.authority, "[::1]:31992");
        assert_eq!(
            monitor_url("http://[::1]/").expect("valid").authority,
            "[::1]:80"
        );
        assert_eq!(
            MonitorUrl::default_url(),
            monitor_url(DEFAULT_MONITOR_URL).expect("valid")
        );
        for bad in [
            "https://x:1/metrics",
            "127.0.0.1:31992",
            "http://",
            "http://x:port/",
            "http://x:99999/",
        ] {
            assert!(monitor_url(bad).is_err(), "{bad:?}");
        }
    }
}
