//! moe-bridge's format machinery (checkpoint validation, name mapping, HF export, HF ↔
//! distributed conversion) exercised on the models' fixtures and tables.

mod check;
mod dist_convert;
mod expected_tables;
mod export;
mod mapping_convert;
