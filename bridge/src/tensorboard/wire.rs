//! The protobuf wire format, as far as the event messages need it: varints, 64-/32-bit fixed
//! fields and length-delimited fields, encoded in field-number order with proto3's rule that
//! fields without presence are left out when they hold their default (as the `protobuf`
//! Python runtime serialises them), and decoded field by field, skipping unknown fields.
//!
//! Decoding never panics and never reads past its buffer: every malformed input (an overlong
//! varint, a length past the end, a group, field number 0) is an `Err` with a reason.

/// A decoded field's value, by wire type (groups, wire types 3 and 4, are refused).
#[derive(Debug, Clone, Copy)]
pub(crate) enum FieldValue<'a> {
    /// Wire type 0.
    Varint(u64),
    /// Wire type 1 (little-endian).
    Fixed64([u8; 8]),
    /// Wire type 2.
    Bytes(&'a [u8]),
    /// Wire type 5 (little-endian).
    Fixed32([u8; 4]),
}

impl<'a> FieldValue<'a> {
    /// The wire type's name, for messages.
    fn wire_name(&self) -> &'static str {
        match self {
            FieldValue::Varint(_) => "varint",
            FieldValue::Fixed64(_) => "64-bit",
            FieldValue::Bytes(_) => "length-delimited",
            FieldValue::Fixed32(_) => "32-bit",
        }
    }

    /// A varint field's value, or an error naming `field` of `message`.
    pub fn varint(self, message: &str, field: &str) -> Result<u64, String> {
        match self {
            FieldValue::Varint(v) => Ok(v),
            other => Err(wrong_wire(message, field, "varint", other)),
        }
    }

    /// A `double` field's value.
    pub fn double(self, message: &str, field: &str) -> Result<f64, String> {
        match self {
            FieldValue::Fixed64(b) => Ok(f64::from_le_bytes(b)),
            other => Err(wrong_wire(message, field, "64-bit", other)),
        }
    }

    /// A `float` field's value.
    pub fn float(self, message: &str, field: &str) -> Result<f32, String> {
        match self {
            FieldValue::Fixed32(b) => Ok(f32::from_le_bytes(b)),
            other => Err(wrong_wire(message, field, "32-bit", other)),
        }
    }

    /// A length-delimited field's bytes (`bytes`, a sub-message or a packed repeated field).
    pub fn bytes(self, message: &str, field: &str) -> Result<&'a [u8], String> {
        match self {
            FieldValue::Bytes(b) => Ok(b),
            other => Err(wrong_wire(message, field, "length-delimited", other)),
        }
    }

    /// A `string` field's value, which proto3 requires to be UTF-8.
    pub fn string(self, message: &str, field: &str) -> Result<String, String> {
        let bytes = self.bytes(message, field)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| format!("{message}.{field} is not valid UTF-8: {e}"))
    }
}

fn wrong_wire(message: &str, field: &str, expected: &str, found: FieldValue<'_>) -> String {
    format!(
        "{message}.{field} has wire type {}, expected {expected}",
        found.wire_name()
    )
}

/// Reads the fields of one message from a byte slice.
pub(crate) struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    /// A decoder over one serialised message.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// The next field (its number and value), `None` at the end of the message.
    pub fn next_field(&mut self) -> Result<Option<(u32, FieldValue<'a>)>, String> {
        if self.pos >= self.buf.len() {
            return Ok(None);
        }
        let at = self.pos;
        let key = self.varint()?;
        let number = key >> 3;
        if number == 0 || number > u64::from(u32::MAX >> 3) {
            return Err(format!("invalid field number {number} at byte {at}"));
        }
        // Lossless: checked against `u32::MAX >> 3` above.
        let number = number as u32;
        let value = match key & 7 {
            0 => FieldValue::Varint(self.varint()?),
            1 => FieldValue::Fixed64(self.array::<8>()?),
            2 => {
                let len = self.varint()?;
                let rest = self.buf.len() - self.pos;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&len| len <= rest)
                    .ok_or_else(|| {
                        format!(
                            "field {number} at byte {at} claims {len} bytes, only {rest} remain"
                        )
                    })?;
                let bytes = &self.buf[self.pos..self.pos + len];
                self.pos += len;
                FieldValue::Bytes(bytes)
            }
            5 => FieldValue::Fixed32(self.array::<4>()?),
            wire => {
                return Err(format!(
                    "field {number} at byte {at} has wire type {wire} (groups and unknown wire \
                     types are not supported)"
                ));
            }
        };
        Ok(Some((number, value)))
    }

    /// A base-128 varint of at most 10 bytes whose value fits 64 bits.
    fn varint(&mut self) -> Result<u64, String> {
        let at = self.pos;
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&byte) = self.buf.get(self.pos) else {
                return Err(format!(
                    "varint at byte {at} runs past the end of the message"
                ));
            };
            self.pos += 1;
            if i == 9 && byte > 1 {
                return Err(format!("varint at byte {at} overflows 64 bits"));
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(format!("varint at byte {at} is longer than 10 bytes"))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let at = self.pos;
        let bytes = self
            .buf
            .get(self.pos..self.pos + N)
            .and_then(|s| <[u8; N]>::try_from(s).ok())
            .ok_or_else(|| {
                format!("{N}-byte fixed field at byte {at} runs past the end of the message")
            })?;
        self.pos += N;
        Ok(bytes)
    }
}

/// Decodes a packed repeated `double` (or a single unpacked element).
pub(crate) fn doubles(
    value: FieldValue<'_>,
    message: &str,
    field: &str,
) -> Result<Vec<f64>, String> {
    match value {
        FieldValue::Fixed64(b) => Ok(vec![f64::from_le_bytes(b)]),
        FieldValue::Bytes(b) if b.len() % 8 == 0 => Ok(b
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect()),
        FieldValue::Bytes(b) => Err(format!(
            "{message}.{field}: packed doubles of {} bytes, not a multiple of 8",
            b.len()
        )),
        other => Err(wrong_wire(
            message,
            field,
            "64-bit or length-delimited",
            other,
        )),
    }
}

/// Decodes a packed repeated `float` (or a single unpacked element).
pub(crate) fn floats(
    value: FieldValue<'_>,
    message: &str,
    field: &str,
) -> Result<Vec<f32>, String> {
    match value {
        FieldValue::Fixed32(b) => Ok(vec![f32::from_le_bytes(b)]),
        FieldValue::Bytes(b) if b.len() % 4 == 0 => Ok(b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        FieldValue::Bytes(b) => Err(format!(
            "{message}.{field}: packed floats of {} bytes, not a multiple of 4",
            b.len()
        )),
        other => Err(wrong_wire(
            message,
            field,
            "32-bit or length-delimited",
            other,
        )),
    }
}

/// Writes one message's fields (callers write them in field-number order).
#[derive(Default)]
pub(crate) struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    /// The serialised message.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire));
    }

    /// An `int64` (or `int32` / enum: negative values sign-extended to 10 bytes).
    pub fn int64(&mut self, field: u32, v: i64) {
        self.key(field, 0);
        self.varint(v as u64);
    }

    /// A `double`.
    pub fn double(&mut self, field: u32, v: f64) {
        self.key(field, 1);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// A `float`.
    pub fn float(&mut self, field: u32, v: f32) {
        self.key(field, 5);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// A length-delimited field: `bytes`, `string`, a sub-message or a packed repeated field.
    pub fn bytes(&mut self, field: u32, v: &[u8]) {
        self.key(field, 2);
        self.varint(v.len() as u64);
        self.buf.extend_from_slice(v);
    }
}
