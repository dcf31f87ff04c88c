//! Running an SPMD job's ranks as threads or as processes, chosen at start-up.
//!
//! The same rank closure runs on every transport: threads of this process ([`World`]); one
//! process per rank over TCP when a torchrun-style launcher started this process (`RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); one process per rank over MPI when `mpirun` /
//! `srun` started it and the build has the `mpi` feature; one process per rank over NCCL (one
//! GPU each) in a build with the `nccl` feature, asked for with [`Transport::Nccl`] or chosen
//! for a launched CUDA job ([`Placement::decide_for`]), bootstrapped over MPI or TCP as the
//! launcher allows. [`run_spmd`] returns this process's result: rank 0's for threads, the local
//! rank's for processes.

use std::time::Duration;

use moe_backend::BackendError;
use moe_backend::comm::launch::Launch;
use moe_backend::comm::tcp::{TcpConfig, TcpWorld};
use moe_backend::comm::{RankCtx, World, WorldConfig};
use moe_backend::parallel::ParallelLayout;

use crate::device::DeviceChoice;

/// How the ranks of a job run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Processes when a launcher started this one (MPI for `mpirun`/`srun` in an `mpi` build,
    /// else TCP), threads otherwise.
    #[default]
    Auto,
    /// All ranks as threads of this process.
    Threads,
    /// One process per rank over TCP (torchrun-style environment).
    Tcp,
    /// One process per rank over MPI (build with `--features mpi`).
    Mpi,
    /// One process per rank over NCCL, one GPU each (build with `--features nccl`); the NCCL
    /// ids travel over MPI (an `mpi` build under `mpirun`/`srun`) or TCP. Started without a
    /// launcher, this process is a world of one.
    Nccl,
}

/// Where the job's ranks run, decided from the transport and the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// `world` threads of this process.
    Threads {
        /// Number of ranks.
        world: usize,
    },
    /// This process is one rank of a multi-process job.
    Process {
        /// The transport.
        transport: Transport,
        /// What the launcher said.
        launch: Option<Launch>,
    },
}

impl Placement {
    /// Decides where the ranks run: `threads_world` ranks as threads unless a launcher started
    /// this process or `transport` asks for processes.
    pub fn decide(transport: Transport, threads_world: usize) -> Result<Self, BackendError> {
        Self::decide_for(transport, threads_world, DeviceChoice::Cpu)
    }

    /// [`Placement::decide`] for a job on `device`: under a launcher, [`Transport::Auto`] picks
    /// NCCL for a CUDA job when the binary has the `nccl` feature (as torchrun jobs of
    /// Megatron do). [`Transport::Nccl`] in a binary without that feature is refused here,
    /// before any work.
    pub fn decide_for(
        transport: Transport,
        threads_world: usize,
        device: DeviceChoice,
    ) -> Result<Self, BackendError> {
        Self::decide_in(transport, threads_world, device, Launch::from_env()?)
    }

    /// [`Placement::decide_for`] with the launcher's announcement given.
    fn decide_in(
        transport: Transport,
        threads_world: usize,
        device: DeviceChoice,
        launch: Option<Launch>,
    ) -> Result<Self, BackendError> {
        if transport == Transport::Nccl && !cfg!(feature = "nccl") {
            return Err(BackendError::Config {
                field: "transport",
                detail: NO_NCCL.into(),
            });
        }
        let multi = launch.as_ref().is_some_and(|l| l.world_size > 1);
        let chosen = match transport {
            Transport::Threads => {
                return Ok(Placement::Threads {
                    world: threads_world,
                });
            }
            Transport::Auto if !multi => {
                return Ok(Placement::Threads {
                    world: threads_world,
                });
            }
            Transport::Auto if device == DeviceChoice::Cuda && cfg!(feature = "nccl") => {
                Transport::Nccl
            }
            Transport::Auto => match launch.as_ref().map(|l| l.launcher) {
                Some("openmpi" | "pmi") if cfg!(feature = "mpi") => Transport::Mpi,
                Some("slurm") if cfg!(feature = "mpi") => Transport::Mpi,
                _ => Transport::Tcp,
            },
            other => other,
        };
        Ok(Placement::Process {
            transport: chosen,
            launch,
        })
    }

    /// Number of ranks of the job.
    pub fn world(&self) -> Option<usize> {
        match self {
            Placement::Threads { world } => Some(*world),
            Placement::Process { launch, .. } => launch.as_ref().map(|l| l.world_size),
        }
    }

    /// The layout `spec` where this placement runs: threads take the spec's world (derived
    /// when it has no `world=`), processes the launcher's process count. Returns the placement
    /// with its thread count set to that world, and the layout.
    pub fn resolve(&self, spec: &str) -> Result<(Placement, ParallelLayout), BackendError> {
        match self {
            Placement::Threads { .. } => {
                let layout = ParallelLayout::parse_spec(spec)?;
                let world = layout.world;
                Ok((Placement::Threads { world }, layout))
            }
            Placement::Process { .. } => {
                let world = self.world().unwrap_or(1);
                Ok((self.clone(), ParallelLayout::parse(world, spec)?))
            }
        }
    }

    /// Whether this process prints the job's progress (rank 0, or the process running the
    /// threads).
    pub fn is_reporter(&self) -> bool {
        match self {
            Placement::Threads { .. } => true,
            Placement::Process { launch, .. } => launch.as_ref().is_none_or(|l| l.rank == 0),
        }
    }
}

/// Why `--transport nccl` is refused in a build without NCCL.
const NO_NCCL: &str = "this build has no NCCL: rebuild with `--features nccl` (cudarc loads \
                       libcuda and libnccl.so at run time; nothing is needed to build it), or \
                       use the TCP or MPI transport";

/// Runs `f` on every rank of the job `placement` describes, waiting at most `timeout` in any
/// collective; returns this process's result (rank 0's for threads). A failing rank makes the
/// whole job fail: threads and TCP processes return the first failure (naming the rank), MPI
/// processes abort the job.
pub fn run_spmd<T, F>(placement: &Placement, timeout: Duration, f: F) -> Result<T, BackendError>
where
    T: Send,
    F: Fn(&RankCtx) -> Result<T, BackendError> + Sync,
{
    match placement {
        Placement::Threads { world } => {
            let config = WorldConfig {
                timeout,
                ..WorldConfig::default()
            };
            let mut first = None;
            let mut errors = Vec::new();
            for (rank, result) in World::run_with(*world, config, f).into_iter().enumerate() {
                match result {
                    Ok(v) if rank == 0 => first = Some(v),
                    Ok(_) => {}
                    Err(e) => errors.push(e),
                }
            }
            // The failing rank's own error rather than the others' "aborted because rank r
            // failed".
            let failure = errors
                .iter()
                .position(|e| !matches!(e, BackendError::Aborted { .. }))
                .or((!errors.is_empty()).then_some(0));
            if let Some(at) = failure {
                return Err(errors.swap_remove(at));
            }
            first.ok_or_else(|| BackendError::Config {
                field: "world",
                detail: "a job needs at least one rank".into(),
            })
        }
        Placement::Process { transport, launch } => match transport {
            Transport::Mpi => run_mpi(timeout, f),
            Transport::Nccl => run_nccl(launch.as_ref(), timeout, f),
            _ => {
                let launch = launch.clone().ok_or_else(|| BackendError::Config {
                    field: "launcher",
                    detail: "TCP processes need a launcher's RANK, WORLD_SIZE, MASTER_ADDR and \
                             MASTER_PORT (torchrun sets them)"
                        .into(),
                })?;
                let world = TcpWorld::init(
                    &launch,
                    TcpConfig {
                        timeout,
                        ..TcpConfig::default()
                    },
                )?;
                world.run(&f)
            }
        },
    }
}

/// The NCCL transport: a host transport bootstraps the ranks (MPI under an MPI launcher in an
/// `mpi` build, TCP under a launcher otherwise, an in-process world of one without a launcher),
/// then every rank opens its GPU and NCCL ([`moe_backend::comm::nccl::nccl_ctx`]).
#[cfg(feature = "nccl")]
fn run_nccl<T, F>(launch: Option<&Launch>, timeout: Duration, f: F) -> Result<T, BackendError>
where
    T: Send,
    F: Fn(&RankCtx) -> Result<T, BackendError> + Sync,
{
    use moe_backend::comm::nccl::{NcclConfig, nccl_ctx};
    let config = NcclConfig {
        timeout,
        local_rank: None,
    };
    let rank = |boot: &RankCtx| -> Result<T, BackendError> {
        let ctx = nccl_ctx(boot, config.clone())?;
        f(&ctx)
    };
    match launch {
        None => {
            let world = WorldConfig {
                timeout,
                ..WorldConfig::default()
            };
            let mut results = World::run_with(1, world, rank);
            results.pop().unwrap_or_else(|| {
                Err(BackendError::Config {
                    field: "world",
                    detail: "a job needs at least one rank".into(),
                })
            })
        }
        Some(l) if matches!(l.launcher, "openmpi" | "pmi" | "slurm") && cfg!(feature = "mpi") => {
            run_mpi(timeout, rank)
        }
        Some(l) => {
            let world = TcpWorld::init(
                l,
                TcpConfig {
                    timeout,
                    ..TcpConfig::default()
                },
            )?;
            world.run(rank)
        }
    }
}

#[cfg(not(feature = "nccl"))]
fn run_nccl<T, F>(_launch: Option<&Launch>, _timeout: Duration, _f: F) -> Result<T, BackendError>
where
    F: Fn(&RankCtx) -> Result<T, BackendError>,
{
    Err(BackendError::Config {
        field: "transport",
        detail: NO_NCCL.into(),
    })
}

#[cfg(feature = "mpi")]
fn run_mpi<T, F>(timeout: Duration, f: F) -> Result<T, BackendError>
where
    F: Fn(&RankCtx) -> Result<T, BackendError>,
{
    use moe_backend::comm::mpi::{MpiConfig, MpiWorld};
    let world = MpiWorld::init(MpiConfig { timeout })?;
    world.run(&f)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi<T, F>(_timeout: Duration, _f: F) -> Result<T, BackendError>
where
    F: Fn(&RankCtx) -> Result<T, BackendError>,
{
    Err(BackendError::Config {
        field: "transport",
        detail: "this build has no MPI: rebuild with `--features mpi` (needs OpenMPI and \
                 libclang), or use the TCP transport (torchrun-style RANK / WORLD_SIZE / \
                 MASTER_ADDR / MASTER_PORT)"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launched(world_size: usize) -> Option<Launch> {
        Some(Launch {
            rank: 0,
            world_size,
            local_rank: 0,
            local_world_size: Some(world_size),
            master_addr: Some("127.0.0.1".into()),
            master_port: Some(29500),
            launcher: "torchrun",
        })
    }

    fn transport_of(p: &Placement) -> Option<Transport> {
        match p {
            Placement::Threads { .. } => None,
            Placement::Process { transport, .. } => Some(*transport),
        }
    }

    #[test]
    fn auto_picks_nccl_for_a_launched_cuda_job_only_with_the_feature() {
        let p = Placement::decide_in(Transport::Auto, 1, DeviceChoice::Cuda, launched(4)).unwrap();
        let expected = if cfg!(feature = "nccl") {
            Transport::Nccl
        } else {
            Transport::Tcp
        };
        assert_eq!(transport_of(&p), Some(expected));
        // CPU jobs and unlaunched CUDA jobs keep their transports.
        let p = Placement::decide_in(Transport::Auto, 1, DeviceChoice::Cpu, launched(4)).unwrap();
        assert_eq!(transport_of(&p), Some(Transport::Tcp));
        let p = Placement::decide_in(Transport::Auto, 2, DeviceChoice::Cuda, None).unwrap();
        assert_eq!(p, Placement::Threads { world: 2 });
    }

    #[cfg(not(feature = "nccl"))]
    #[test]
    fn nccl_without_the_feature_is_refused_before_any_work() {
        for launch in [None, launched(2)] {
            let err = Placement::decide_in(Transport::Nccl, 1, DeviceChoice::Cuda, launch)
                .unwrap_err()
                .to_string();
            assert!(err.contains("this build has no NCCL"), "{err}");
            assert!(err.contains("--features nccl"), "{err}");
        }
    }

    #[cfg(feature = "nccl")]
    #[test]
    fn nccl_without_a_launcher_is_one_process() {
        let p = Placement::decide_in(Transport::Nccl, 1, DeviceChoice::Cuda, None).unwrap();
        assert_eq!(transport_of(&p), Some(Transport::Nccl));
        assert_eq!(p.world(), None);
        assert!(p.is_reporter());
    }
}
