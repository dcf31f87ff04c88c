//! Starting a bench binary as TCP processes, as torchrun starts its workers.

use std::process::{Command, Stdio};

/// Runs this bench binary as `n` processes with torchrun's variables (`RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT` on a free local port), each given `args`; returns their
/// standard outputs, concatenated in rank order. Panics when a rank fails (a bench).
pub fn tcp_processes(n: usize, args: &[&str]) -> String {
    let exe = std::env::current_exe().expect("bench binary");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let children: Vec<_> = (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .spawn()
                .expect("bench process")
        })
        .collect();
    let mut text = String::new();
    for child in children {
        let out = child.wait_with_output().expect("bench process");
        assert!(out.status.success(), "a TCP rank failed");
        text.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    text
}
