//! What the launcher told this process: rank, world size and local rank from the environment
//! variables of torchrun, Slurm, OpenMPI and MPICH/PMI, so the same binary runs under
//! `mpirun -np 4 moe train …`, `srun moe train …` or `torchrun --nproc-per-node 8 --no-python
//! moe train …`.
//!
//! The process transport itself decides who its peers are (MPI knows its world); [`Launch`]
//! is what the process can tell before the transport starts, and what the transport's own view
//! is checked against, so a process started by a launcher its transport cannot join (torchrun
//! without an MPI runtime) fails with an error instead of training alone.

use std::collections::HashMap;

use crate::error::{BackendError, Result};

/// One process's place in a multi-process job, as its launcher announced it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Global rank of this process.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes of this node (selects the GPU).
    pub local_rank: usize,
    /// Processes on this node, when the launcher says (`LOCAL_WORLD_SIZE`,
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`, `SLURM_NTASKS_PER_NODE`).
    pub local_world_size: Option<usize>,
    /// Rendezvous host (torchrun `MASTER_ADDR`), when given.
    pub master_addr: Option<String>,
    /// Rendezvous port (torchrun `MASTER_PORT`), when given.
    pub master_port: Option<u16>,
    /// Which launcher's variables were read (`torchrun`, `slurm`, `openmpi`, `pmi`).
    pub launcher: &'static str,
}

/// (launcher, rank, size, local rank, local size) variable names, in the order they are tried:
/// an explicit torchrun-style `RANK`/`WORLD_SIZE` wins, then the MPI launchers, then Slurm
/// (whose variables are also set around an `mpirun` inside an allocation).
const SOURCES: [(&str, &str, &str, &str, &str); 4] = [
    (
        "torchrun",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "pmi",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
    (
        "slurm",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ),
];

impl Launch {
    /// The launch described by the process environment; `Ok(None)` for a process started by
    /// hand (no launcher variables), an error naming the variable when one is malformed.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// [`Launch::from_env`] over an explicit variable map.
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<Self>> {
        for (launcher, rank_var, size_var, local_var, local_size_var) in SOURCES {
            let (Some(rank), Some(size)) = (vars.get(rank_var), vars.get(size_var)) else {
                continue;
            };
            let parse = |name: &'static str, value: &str| -> Result<usize> {
                value
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| BackendError::Config {
                        field: name,
                        detail: format!("environment variable {name}={value:?} is not a count"),
                    })
            };
            let rank = parse(rank_var_static(rank_var), rank)?;
            let world_size = parse(rank_var_static(size_var), size)?;
            if world_size == 0 || rank >= world_size {
                return Err(BackendError::Config {
                    field: rank_var_static(rank_var),
                    detail: format!(
                        "{launcher} announced rank {rank} of a world of {world_size} \
                         ({rank_var}, {size_var})"
                    ),
                });
            }
            let local_rank = match vars.get(local_var) {
                Some(v) => parse(rank_var_static(local_var), v)?,
                None => 0,
            };
            let local_world_size = match vars.get(local_size_var) {
                Some(v) => {
                    let n = parse(rank_var_static(local_size_var), v)?;
                    if n == 0 || local_rank >= n {
                        return Err(BackendError::Config {
                            field: rank_var_static(local_size_var),
                            detail: format!(
                                "{launcher} announced local rank {local_rank} of {n} local \
                                 processes ({local_var}, {local_size_var})"
                            ),
                        });
                    }
                    Some(n)
                }
                None => None,
            };
            let master_port = match vars.get("MASTER_PORT") {
                Some(p) => Some(p.trim().parse::<u16>().map_err(|_| BackendError::Config {
                    field: "MASTER_PORT",
                    detail: format!("environment variable MASTER_PORT={p:?} is not a port"),
                })?),
                None => None,
            };
            return Ok(Some(Self {
                rank,
                world_size,
                local_rank,
                local_world_size,
                master_addr: vars.get("MASTER_ADDR").cloned(),
                master_port,
                launcher,
            }));
        }
        Ok(None)
    }
}

/// The `'static` name of a launcher variable (for error fields).
fn rank_var_static(name: &str) -> &'static str {
    SOURCES
        .iter()
        .flat_map(|(_, a, b, c, d)| [*a, *b, *c, *d])
        .find(|v| *v == name)
        .unwrap_or("launcher environment")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn reads_each_launcher() {
        let l = Launch::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.rank, l.world_size, l.local_rank, l.launcher),
            (3, 8, 1, "torchrun")
        );
        assert_eq!(l.local_world_size, Some(4));
        assert_eq!(l.master_port, Some(29500));
        let l = Launch::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.launcher), (2, 4, "openmpi"));
        let l = Launch::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank), (5, 16, 1));
        assert_eq!(l.local_world_size, None);
        assert_eq!(Launch::from_vars(&vars(&[("PATH", "/bin")])).unwrap(), None);
    }

    #[test]
    fn malformed_variables_are_named() {
        let err = Launch::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=\"x\""), "{err}");
        let err = Launch::from_vars(&vars(&[("RANK", "4"), ("WORLD_SIZE", "4")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 4 of a world of 4"), "{err}");
        let err = Launch::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("local rank 2 of 2 local processes"), "{err}");
    }
}
